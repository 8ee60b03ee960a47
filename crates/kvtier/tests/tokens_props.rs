//! Property test: `TokenBlockSequence` yields the same hashes as `sequence_hashes` for any
//! split of the tokens into `append` calls and any truncation.
#![allow(clippy::unwrap_used)]
use std::num::NonZeroUsize;

use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::tokens::TokenBlockSequence;
use proptest::prelude::*;

proptest! {
    #[test]
    fn incremental_hashing_equals_one_shot(
        tokens in proptest::collection::vec(any::<u32>(), 0..300),
        cuts in proptest::collection::vec(1usize..40, 1..20),
        bs in 1usize..70,
        keep in 0usize..300,
    ) {
        let salt = HashSalt::new("m", Some("lora"), Some("tenant"));
        let mut s = TokenBlockSequence::new(salt, NonZeroUsize::new(bs).unwrap());
        let mut got = Vec::new();
        let mut rest = &tokens[..];
        let mut i = 0;
        while !rest.is_empty() {
            let n = cuts[i % cuts.len()].min(rest.len());
            got.extend_from_slice(s.append(&rest[..n]));
            rest = &rest[n..];
            i += 1;
        }
        let want = sequence_hashes(salt, &tokens, bs);
        prop_assert_eq!(&got, &want);
        prop_assert_eq!(s.hashes(), &want[..]);
        prop_assert_eq!(s.partial_len(), tokens.len() % bs);
        s.truncate(keep);
        let k = keep.min(tokens.len());
        prop_assert_eq!(s.hashes(), &sequence_hashes(salt, &tokens[..k], bs)[..]);
    }
}
