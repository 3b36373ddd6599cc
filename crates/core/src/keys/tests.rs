use proptest::prelude::*;

use super::*;

#[test]
fn only_full_blocks_get_keys() {
    let tokens: Vec<u32> = (0..47).collect();
    assert_eq!(router_keys(&tokens, 16, None).unwrap().len(), 2);
    assert!(router_keys(&tokens[..15], 16, None).unwrap().is_empty());
}

#[test]
fn a_block_key_depends_on_its_whole_prefix() {
    let a: Vec<u32> = (0..32).collect();
    let mut b = a.clone();
    b[0] = 999;
    let ka = router_keys(&a, 16, None).unwrap();
    let kb = router_keys(&b, 16, None).unwrap();
    // Block 1 has the same tokens in both, but a different parent.
    assert_ne!(ka[1], kb[1]);
}

#[test]
fn salt_and_lora_separate_otherwise_equal_prompts() {
    let tokens: Vec<u32> = (0..48).collect();
    let plain = router_keys(&tokens, 16, None).unwrap();
    let salted_extra = request_extra_keys(3, None, Some("tenant-a"));
    let salted = router_keys(&tokens, 16, Some(&salted_extra)).unwrap();
    let lora_extra = request_extra_keys(3, Some("my-lora"), None);
    let lora = router_keys(&tokens, 16, Some(&lora_extra)).unwrap();
    for i in 0..3 {
        assert_ne!(plain[i], salted[i], "block {i}");
        assert_ne!(plain[i], lora[i], "block {i}");
        assert_ne!(salted[i], lora[i], "block {i}");
    }
    // Extra keys made of all `None` entries hash exactly like no extra keys at all.
    let none_extra = request_extra_keys(3, None, None);
    assert_eq!(router_keys(&tokens, 16, Some(&none_extra)).unwrap(), plain);
}

#[test]
fn salt_goes_on_the_first_block_only() {
    let extra = request_extra_keys(3, Some("l"), Some("s"));
    assert_eq!(
        extra[0],
        Some(vec![ExtraKey::Str("l".into()), ExtraKey::Str("s".into())])
    );
    assert_eq!(extra[1], Some(vec![ExtraKey::Str("l".into())]));
}

#[test]
fn bad_arguments_are_errors() {
    assert!(matches!(
        router_keys(&[1, 2], 0, None),
        Err(CoreError::InvalidBlockSize(0))
    ));
    let extra = vec![None];
    assert!(matches!(
        router_keys(&[0; 32], 16, Some(&extra)),
        Err(CoreError::ExtraKeysLength {
            blocks: 2,
            extra: 1
        })
    ));
}

#[test]
fn cbor_of_negative_and_nested_extra_keys() {
    // -1 is CBOR 0x20, -25 is 0x38 0x18; nested lists are arrays.
    let bytes = cbor_extra_keys(Some(&[
        ExtraKey::Int(-1),
        ExtraKey::Int(-25),
        ExtraKey::List(vec![ExtraKey::Str("a".into()), ExtraKey::Int(3)]),
        ExtraKey::Bytes(vec![7]),
    ]));
    assert_eq!(
        bytes,
        [0x84, 0x20, 0x38, 0x18, 0x82, 0x61, b'a', 0x03, 0x41, 0x07]
    );
    assert_eq!(cbor_extra_keys(None), [0xf6]);
}

proptest! {
    #[test]
    fn keys_of_a_prefix_are_a_prefix_of_keys(
        tokens in proptest::collection::vec(0u32..200_000, 0..200),
        cut in 0usize..200,
        block_size in 1usize..40,
    ) {
        let cut = cut.min(tokens.len());
        let full = router_keys(&tokens, block_size, None).unwrap();
        let part = router_keys(&tokens[..cut], block_size, None).unwrap();
        prop_assert_eq!(&full[..part.len()], &part[..]);
    }

    #[test]
    fn chaining_from_a_parent_continues_the_chain(
        tokens in proptest::collection::vec(any::<u32>(), 32..160),
    ) {
        let all = router_keys(&tokens, 16, None).unwrap();
        let tail = router_keys_from(all[0], &tokens[16..], 16, None).unwrap();
        prop_assert_eq!(&all[1..], &tail[..]);
    }
}
