"""The reference for `tokenize`: Python `transformers` renders and tokenizes the same conversations.

Reads conversation datasets (folders joined by `:`) and the token dataset dflash made from it (both as exported Arrow
stream files), renders every conversation with `tokenizer.apply_chat_template`, tokenizes it with
the tokenizer's offsets, derives the loss mask by the rule dflash documents (generated spans from
the template, tokens whose character range overlaps one), and compares ids and masks row by row.
Prints a JSON report; exits 1 on any difference.

usage: tokenize_reference.py MODEL_DIR CONVERSATION_DIRS TOKENS_DIR KWARGS_JSON TRAIN_ON REASONING
"""

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
    """`transformers` templating and tokenization with dflash's loss-mask rule."""

    def __init__(self, tok, kwargs, train_on):
        self.tok, self.kwargs, self.train_on = tok, kwargs, train_on
        self.end_tokens = [tok.eos_token] if tok.eos_token else []

    def render(self, msgs, tools, gen):
        return self.tok.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=gen, **self.kwargs
        )

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

        def marked(only):
            m2 = [dict(m) for m in msgs]
            for i in only:
                c = m2[i]["content"]
                body = c.rstrip()
                m2[i]["content"] = body + marker + c[len(body):]
            out = render(m2, tools, False)
            if out.replace(marker, "") != full or out.count(marker) != len(only):
                return None
            pos = [p for p, ch in enumerate(out) if ch == marker]
            return [p - k for k, p in enumerate(pos)]

        with_content = [i for i in chosen if msgs[i]["content"]]
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
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = []
        s = 0
        for a, b in enc["offset_mapping"]:
            while s < len(sp or []) and a >= sp[s][1]:
                s += 1
            mask.append(1 if sp and s < len(sp) and b > sp[s][0] else 0)
        return full, enc["input_ids"], mask, sp


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
    tok = AutoTokenizer.from_pretrained(model)
    kwargs = json.loads(kwargs)
    ref = Reference(tok, kwargs, train_on)

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
                    segs.append(tok.decode(cur))
                    cur = []
            if cur:
                segs.append(tok.decode(cur))
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
                "dflash": tok.decode(row["input_ids"][max(0, i - 3):i + 3]),
                "transformers": tok.decode(ids[max(0, i - 3):i + 3])})
        elif row["loss_mask"] != mask or row["length"] != len(ids):
            i = next(k for k, (x, y) in enumerate(zip(row["loss_mask"], mask)) if x != y)
            report["mismatches"].append({
                "id": key, "what": "loss_mask", "at": i, "dflash": row["loss_mask"][i],
                "transformers": mask[i], "token": tok.decode(ids[i:i + 1]),
                "context": tok.decode(ids[max(0, i - 8):i + 8])})
    report["mismatches"] = report["mismatches"][:10]
    print(json.dumps(report))
    sys.exit(1 if report["mismatches"] else 0)


if __name__ == "__main__":
    main()
