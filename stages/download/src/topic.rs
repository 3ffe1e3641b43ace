//! `category: auto`: a row's category judged from its text, for sources that have none (ShareGPT
//! is all "chat" otherwise), so `mix` can rebalance by what the prompts are about, as the
//! story's data was found to be 77% code.
//!
//! A transparent rule, not a model: the first user turn and the first reply are scored for
//! code (fenced blocks, programming words and symbols) and for math (maths words, arithmetic
//! between numbers); the higher score wins at 2 points or more, else the row is `chat`. Rows
//! that are both go to `code`. The rule is deliberately plain so a user can predict it; the
//! download's stats count what it decided.

/// The rules' version: it enters the key of every `category: auto` download (change it with
/// any change below, so earlier artifacts stay what they were).
pub const RULES: &str = "topic-rules-2";

/// Words that point at programming, matched whole and lowercased.
const CODE_WORDS: &[&str] = &[
    "python",
    "javascript",
    "typescript",
    "java",
    "rust",
    "golang",
    "sql",
    "html",
    "css",
    "regex",
    "def",
    "import",
    "compile",
    "compiler",
    "debug",
    "api",
    "json",
    "numpy",
    "pandas",
    "react",
    "npm",
    "code",
    "programming",
    "algorithm",
    "variable",
    "recursion",
    "bash",
    "script",
    "dataframe",
    "kotlin",
    "swift",
    "php",
    "django",
    "flask",
    "github",
    "docker",
    "kubernetes",
    "class",
    "function",
    "loop",
    "array",
    "string",
    "crud",
    "database",
    "backend",
    "frontend",
    "microservice",
    "microservices",
    "sdk",
    "linux",
    "git",
    "endpoint",
    "query",
    "c++",
    "c#",
];

/// Character sequences only code has (none repeating a word above, which would count twice).
const CODE_MARKS: &[&str] = &[
    "();",
    "){",
    ") {",
    "=>",
    "==",
    "!=",
    "#include",
    "print(",
    "console.log",
    "std::",
    "</",
    "/>",
    "self.",
    "::",
    "int main",
];

/// Words that point at mathematics, matched whole and lowercased.
const MATH_WORDS: &[&str] = &[
    "solve",
    "calculate",
    "equation",
    "equations",
    "integral",
    "derivative",
    "probability",
    "percent",
    "percentage",
    "average",
    "remainder",
    "divisible",
    "prime",
    "fraction",
    "ratio",
    "perimeter",
    "volume",
    "algebra",
    "geometry",
    "theorem",
    "proof",
    "matrix",
    "sum",
    "product",
    "multiply",
    "divide",
    "math",
    "mathematics",
    "arithmetic",
    "polynomial",
    "logarithm",
    "factorial",
    "triangle",
    "circle",
    "radius",
    "decimal",
];

/// The category of a row from its first user turn and first reply: `code`, `math` or `chat`.
pub fn classify(prompt: &str, reply: &str) -> &'static str {
    let text = format!("{prompt}\n{reply}");
    let lower = text.to_lowercase();
    let words: std::collections::BTreeSet<&str> = lower
        .split(|c: char| !(c.is_alphanumeric() || c == '+' || c == '#'))
        .filter(|w| !w.is_empty())
        .collect();
    let mut code = CODE_WORDS.iter().filter(|w| words.contains(**w)).count();
    code += CODE_MARKS.iter().filter(|m| text.contains(**m)).count();
    if text.contains("```") {
        code += 3;
    }
    let mut math = MATH_WORDS.iter().filter(|w| words.contains(**w)).count();
    math += arithmetic(&text).min(3);
    if code >= 2 && code >= math {
        "code"
    } else if math >= 2 {
        "math"
    } else {
        "chat"
    }
}

/// How many times a number is followed by an arithmetic operator and another number
/// (`3 + 4`, `12*7`, `5 = 20`). `-` and `/` count only with spaces around them: written tight
/// they are dates, ranges and fractions of recipes (`2023-01-05`, `10-20`, `1/2 cup`).
fn arithmetic(text: &str) -> usize {
    let chars: Vec<char> = text.chars().collect();
    let mut count = 0;
    for (i, &c) in chars.iter().enumerate() {
        if !"+-*/=^×÷".contains(c) || i == 0 || i + 1 == chars.len() {
            continue;
        }
        if "-/".contains(c) && !(chars[i - 1] == ' ' && chars[i + 1] == ' ') {
            continue;
        }
        let before = chars[..i].iter().rev().find(|c| !c.is_whitespace());
        let after = chars[i + 1..].iter().find(|c| !c.is_whitespace());
        if before.is_some_and(|c| c.is_ascii_digit()) && after.is_some_and(|c| c.is_ascii_digit()) {
            count += 1;
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::classify;

    #[test]
    fn code_math_and_chat_are_told_apart() {
        assert_eq!(
            classify("Write a Python function that reverses a string.", ""),
            "code"
        );
        assert_eq!(
            classify(
                "Why does this fail?",
                "```\nfor i in range(3): print(i)\n```"
            ),
            "code"
        );
        assert_eq!(
            classify(
                "Natalia sold 48 clips in April and half as many in May. How many in total? Calculate it.",
                "48 / 2 = 24, and 48 + 24 = 72."
            ),
            "math"
        );
        assert_eq!(classify("Solve the equation 3x + 5 = 20.", ""), "math");
        assert_eq!(
            classify("Write a poem about the sea.", "The sea..."),
            "chat"
        );
        assert_eq!(
            classify("What should I see in Paris in two days?", "The Louvre, ..."),
            "chat"
        );
        // Dates and ranges are not arithmetic.
        assert_eq!(
            classify(
                "Summarise the news of 2023-01-05 and 2023-02-10, pages 10-20.",
                ""
            ),
            "chat"
        );
        // A word counts once: "def" in prose is not code.
        assert_eq!(classify("What is the def of irony?", ""), "chat");
        assert_eq!(classify("Is C++ or C# better for games?", ""), "code");
        // One programming word alone is not enough.
        assert_eq!(
            classify("Tell me about the history of Java, the island.", ""),
            "chat"
        );
    }
}
