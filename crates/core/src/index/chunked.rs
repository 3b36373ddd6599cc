//! A vector that grows by fixed chunks, never moving what it holds: no push copies the
//! elements before it, so an index that holds millions of small records never pauses to move
//! them all (a `Vec` doubling 8 MB of records took about a millisecond).

/// Elements per chunk.
const CHUNK: usize = 4096;

/// A growable array of `T` in chunks of [`CHUNK`] elements.
#[derive(Clone, Debug, Default)]
pub(crate) struct ChunkedVec<T> {
    chunks: Vec<Box<[T]>>,
    len: usize,
}

impl<T: Copy + Default> ChunkedVec<T> {
    /// Appends `value`; returns its index.
    pub(crate) fn push(&mut self, value: T) -> usize {
        let at = self.len;
        if at == self.chunks.len() * CHUNK {
            self.chunks
                .push(vec![T::default(); CHUNK].into_boxed_slice());
        }
        self.chunks[at / CHUNK][at % CHUNK] = value;
        self.len += 1;
        at
    }

    /// Elements pushed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.chunks.capacity() * size_of::<Box<[T]>>() + self.chunks.len() * CHUNK * size_of::<T>()
    }

    /// The elements, in order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flat_map(|c| c.iter()).take(self.len)
    }
}

impl<T> std::ops::Index<usize> for ChunkedVec<T> {
    type Output = T;

    #[inline]
    fn index(&self, at: usize) -> &T {
        debug_assert!(at < self.len, "index {at} past {}", self.len);
        &self.chunks[at / CHUNK][at % CHUNK]
    }
}

impl<T> std::ops::IndexMut<usize> for ChunkedVec<T> {
    #[inline]
    fn index_mut(&mut self, at: usize) -> &mut T {
        debug_assert!(at < self.len, "index {at} past {}", self.len);
        &mut self.chunks[at / CHUNK][at % CHUNK]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_what_was_pushed_across_chunks() {
        let mut v = ChunkedVec::default();
        for i in 0..3 * CHUNK + 5 {
            assert_eq!(v.push(i as u64 * 3), i);
        }
        assert_eq!(v.len(), 3 * CHUNK + 5);
        v[CHUNK] = 7;
        assert_eq!(v[CHUNK], 7);
        assert_eq!(v[3 * CHUNK + 4], (3 * CHUNK + 4) as u64 * 3);
        assert_eq!(v.iter().count(), 3 * CHUNK + 5);
    }
}
