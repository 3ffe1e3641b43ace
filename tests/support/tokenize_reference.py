"""The reference for `tokenize`: Python `transformers` renders and tokenizes the same conversations.

Reads conversation datasets (folders joined by `:`) and the token dataset dflash made from it (both as exported Arrow
stream files), renders every conversation with `tokenizer.apply_chat_template`, tokenizes it with
the tokenizer's offsets, derives the loss mask by the rule dflash documents (generated spans from
the template, tokens whose character range overlaps one), and compares ids and masks row by row.
Prints a JSON report; exits 1 on any difference.

usage: tokenize_reference.py MODEL_DIR CONVERSATION_DIRS TOKENS_DIR KWARGS_JSON TRAIN_ON REASONING
"""

import bisect
import json
import os
import sys

import pyarrow as pa
from transformers import AutoTokenizer


def read_dir(d):
    tables = [
        pa.ipc.open_stream(open(os.path.join(d, f), "rb")).read_all()
        for f in sorted(os.listdir(d))
        if f.endswith(".arrow")
    ]
    return [row for t in tables for row in t.to_pylist()]


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Reference:
    """Templating and tokenization by a reference implementation, with dflash's loss-mask rule.

    `render(msgs, tools, add_generation_prompt)` gives the text; `tokenize(text)` gives ids and
    character offsets; a turn ends after the first of `end_tokens` after its content.
    """

    def __init__(self, render, tokenize, end_tokens, train_on):
        self.render, self.tokenize = render, tokenize
        self.end_tokens, self.train_on = end_tokens, train_on

    @classmethod
    def transformers(cls, tok, kwargs, train_on):
        """`apply_chat_template` and the fast tokenizer's offsets."""
        def render(msgs, tools, gen):
            return tok.apply_chat_template(
                msgs, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs)

        def tokenize(text):
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            return enc["input_ids"], enc["offset_mapping"]

        return cls(render, tokenize, [tok.eos_token] if tok.eos_token else [], train_on)

    @classmethod
    def llama_cpp(cls, path, kwargs, train_on):
        """llama.cpp's own tokenizer for a GGUF file, and its template rendered by `transformers`."""
        from llama_cpp import Llama
        from transformers.utils.chat_template_utils import render_jinja_template

        import ctypes
        import llama_cpp

        llm = Llama(model_path=path, vocab_only=True, verbose=False)
        buf = ctypes.create_string_buffer(4096)

        def piece(t):
            # The raw C call: `Llama.detokenize` cuts pieces at 32 bytes.
            n = llama_cpp.llama_token_to_piece(llm._model.vocab, t, buf, len(buf), 0, True)
            return buf.raw[:n]

        special = {"bos_token": piece(llm.token_bos()).decode(), "eos_token": piece(llm.token_eos()).decode()}
        template = llm.metadata["tokenizer.chat_template"]

        def render(msgs, tools, gen):
            out, _ = render_jinja_template(conversations=[msgs], tools=tools, chat_template=template,
                                           add_generation_prompt=gen, **special, **kwargs)
            return out[0]

        def tokenize(text):
            ids = llm.tokenize(text.encode(), add_bos=False, special=True)
            # Byte offsets from the pieces, then characters: a token that splits a character
            # covers that whole character (what fast tokenizers report, too).
            data = text.encode()
            char_starts = [b for b in range(len(data)) if (data[b] & 0xC0) != 0x80]
            offsets, pos = [], 0
            for t in ids:
                end = pos + len(piece(t))
                offsets.append((bisect.bisect_right(char_starts, pos) - 1, bisect.bisect_left(char_starts, end)))
                pos = end
            assert pos == len(data), "pieces do not add up to the text"
            return ids, offsets

        ref = cls(render, tokenize, [special["eos_token"]], train_on)
        ref.decode = lambda ids: b"".join(piece(t) for t in ids).decode(errors="replace")
        return ref

    def spans(self, msgs, tools):
        render = self.render
        full = render(msgs, tools, False)
        chosen = [i for i, m in enumerate(msgs) if i > 0 and m["role"] == "assistant"]
        if self.train_on == "last":
            chosen = chosen[-1:]
        if not chosen:
            return full, None
        starts = [common_prefix(render(msgs[:i], tools, True), full) for i in chosen]
        marker = next(
            chr(c)
            for c in range(0xE000, 0xF900)
            if chr(c) not in full and all(chr(c) not in m["content"] for m in msgs)
        )

        def marked(only, at_start=False):
            m2 = [dict(m) for m in msgs]
            for i in only:
                c = m2[i]["content"]
                if at_start:
                    body = c.lstrip()
                    m2[i]["content"] = c[: len(c) - len(body)] + marker + body
                    continue
                body = c.rstrip()
                m2[i]["content"] = body + marker + c[len(body):]
            out = render(m2, tools, False)
            if out.replace(marker, "") != full or out.count(marker) != len(only):
                return None
            pos = [p for p, ch in enumerate(out) if ch == marker]
            return [p - k for k, p in enumerate(pos)]

        with_content = [i for i in chosen if msgs[i]["content"]]
        # A turn starts no later than its content (the prompt's agreement can run into a reply
        # that begins like the generation prompt's tail).
        for i in with_content:
            one = marked([i], at_start=True)
            if one is not None:
                k = chosen.index(i)
                starts[k] = min(starts[k], one[0])
        ends = dict(zip(chosen, starts))
        if with_content:
            found = marked(with_content)
            if found is None:
                found = []
                for i in with_content:
                    one = marked([i])
                    if one is None:
                        raise ValueError(f"turn {i} cannot be located")
                    found.append(one[0])
            ends.update(zip(with_content, found))
        out = []
        for k, i in enumerate(chosen):
            start, ce = starts[k], ends[i]
            limit = starts[k + 1] if k + 1 < len(starts) else len(full)
            hits = [full.find(t, ce, limit) for t in self.end_tokens]
            hits = [h + len(t) for h, t in zip(hits, self.end_tokens) if h >= 0]
            out.append((start, min(hits) if hits else ce))
        return full, out

    def encode(self, msgs, tools):
        """(text, ids, mask, spans) of one conversation."""
        full, sp = self.spans(msgs, tools)
        ids, offsets = self.tokenize(full)
        mask = []
        s = 0
        for a, b in offsets:
            while s < len(sp or []) and a >= sp[s][1]:
                s += 1
            mask.append(1 if sp and s < len(sp) and b > sp[s][0] else 0)
        return full, ids, mask, sp


def messages(conv, reasoning):
    """A dflash conversation row as `transformers` messages."""
    msgs = []
    for m in conv["messages"]:
        msg = {"role": m["role"], "content": m["content"]}
        if reasoning == "keep" and m["reasoning"] is not None:
            msg["reasoning_content"] = m["reasoning"]
        if m["tool_calls"] is not None:
            msg["tool_calls"] = json.loads(m["tool_calls"])
        msgs.append(msg)
    tools = json.loads(conv["tools"]) if conv["tools"] is not None else None
    return msgs, tools


def main():
    model, conv_dir, tok_dir, kwargs, train_on, reasoning = sys.argv[1:]
    kwargs = json.loads(kwargs)
    if model.endswith(".gguf"):
        tok = None
        ref = Reference.llama_cpp(model, kwargs, train_on)
    else:
        tok = AutoTokenizer.from_pretrained(model)
        ref = Reference.transformers(tok, kwargs, train_on)
    decode = ref.decode if tok is None else tok.decode

    convs = [r for d in conv_dir.split(os.pathsep) for r in read_dir(d)]
    got = {(r["source"], r["id"]): r for r in read_dir(tok_dir)}
    report = {"conversations": len(convs), "compared": 0, "expected_dropped": 0,
              "with_reasoning": 0, "with_tool_calls": 0, "with_tools": 0, "non_ascii": 0,
              "multi_turn": 0, "masked_tokens": 0, "tokens": 0, "segments": {}, "mismatches": []}
    for conv in convs:
        msgs, tools = messages(conv, reasoning)
        key = (conv["source"], conv["id"])
        full, ids, mask, sp = ref.encode(msgs, tools)
        # apply_chat_template's own tokenization must agree with tokenizing its text.
        if tok is not None:
            direct = tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=False, **kwargs)
            if hasattr(direct, "tolist"):
                direct = direct.tolist()
            if list(direct) != ids:
                report["mismatches"].append({"id": key, "what": "apply_chat_template(tokenize=True) differs"})
        if not sp or 1 not in mask:
            report["expected_dropped"] += 1
            if key in got:
                report["mismatches"].append({"id": key, "what": "dflash kept a row with nothing to train"})
            continue
        if key not in got:
            report["mismatches"].append({"id": key, "what": "dflash dropped the row"})
            continue
        row = got[key]
        report["compared"] += 1
        if conv["source"] == "crafted":
            # The trained text, run by run, for the tests to read.
            segs, cur = [], []
            for t, m in zip(row["input_ids"], row["loss_mask"]):
                if m:
                    cur.append(t)
                elif cur:
                    segs.append(decode(cur))
                    cur = []
            if cur:
                segs.append(decode(cur))
            report["segments"][conv["id"]] = segs
        report["tokens"] += len(ids)
        report["masked_tokens"] += sum(mask)
        report["with_reasoning"] += any("reasoning_content" in m for m in msgs)
        report["with_tool_calls"] += any("tool_calls" in m for m in msgs)
        report["with_tools"] += tools is not None
        report["non_ascii"] += not full.isascii()
        report["multi_turn"] += sum(m["role"] == "assistant" for m in msgs) > 1
        if row["input_ids"] != ids:
            i = next((k for k, (x, y) in enumerate(zip(row["input_ids"], ids)) if x != y),
                     min(len(ids), len(row["input_ids"])))
            report["mismatches"].append({
                "id": key, "what": "input_ids", "at": i,
                "dflash": decode(row["input_ids"][max(0, i - 3):i + 3]),
                "transformers": decode(ids[max(0, i - 3):i + 3])})
        elif row["loss_mask"] != mask or row["length"] != len(ids):
            i = next(k for k, (x, y) in enumerate(zip(row["loss_mask"], mask)) if x != y)
            report["mismatches"].append({
                "id": key, "what": "loss_mask", "at": i, "dflash": row["loss_mask"][i],
                "transformers": mask[i], "token": decode(ids[i:i + 1]),
                "context": decode(ids[max(0, i - 8):i + 8])})
    report["mismatches"] = report["mismatches"][:10]
    print(json.dumps(report))
    sys.exit(1 if report["mismatches"] else 0)


if __name__ == "__main__":
    main()
