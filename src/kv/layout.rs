//! KV-cache layouts: per layer, the buffers (key, value, index) an engine
//! keeps, where they live and how many bytes one block of each takes.
//!
//! Every size is computed with checked arithmetic: an overflow is an error,
//! never a wrap.

use crate::desc::RegionId;
use crate::error::{Error, Result};
use crate::mem::RegionKind;
use crate::proto;

/// How attention stores its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Attention {
    /// Multi-head (and grouped-query) attention: key and value buffers,
    /// sharded by KV head across tensor-parallel ranks.
    Mha,
    /// Multi-head latent attention (DeepSeek): one latent buffer (kept as
    /// `Key`) and maybe an index buffer; no value buffer; identical on every
    /// tensor-parallel rank.
    Mla,
}

/// One buffer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBuffer {
    /// Key (or MLA latent), value or index.
    pub kind: RegionKind,
    /// The region it lives in.
    pub region: RegionId,
    /// Its offset in the region.
    pub offset: u64,
    /// Bytes of one block.
    pub block_bytes: u64,
}

/// A model's cache shape, before it is placed in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    /// MHA/GQA or MLA.
    pub attention: Attention,
    /// Model layers.
    pub layers: u32,
    /// Blocks per buffer.
    pub blocks: u64,
    /// Bytes per block of the key (MLA: latent) buffer.
    pub key_block_bytes: u64,
    /// Bytes per block of the value buffer (0 for MLA).
    pub value_block_bytes: u64,
    /// Bytes per block of the index buffer (0: none).
    pub index_block_bytes: u64,
}

fn checked_mul(values: &[u64], what: &'static str) -> Result<u64> {
    values
        .iter()
        .try_fold(1u64, |acc, &v| acc.checked_mul(v))
        .ok_or_else(|| Error::invalid(what, format!("{values:?} overflows 64 bits")))
}

impl CacheShape {
    /// An MHA/GQA cache as one tensor-parallel rank holds it: its share of
    /// the KV heads (at least one: with fewer heads than ranks, heads are
    /// replicated), key and value, `dtype_bytes` per element.
    ///
    /// ```
    /// use kvring::kv::CacheShape;
    /// // Llama-3-8B-like: 32 layers, 8 KV heads of 128, bf16, 16-token blocks, tp 2.
    /// let shape = CacheShape::mha(32, 1000, 8, 128, 2, 16, 2).unwrap();
    /// assert_eq!(shape.key_block_bytes, 4 * 128 * 2 * 16);
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn mha(
        layers: u32,
        blocks: u64,
        kv_heads: u64,
        head_dim: u64,
        dtype_bytes: u64,
        tokens_per_block: u64,
        tp: u64,
    ) -> Result<Self> {
        if tp == 0 || kv_heads == 0 {
            return Err(Error::invalid("cache shape", "tp size and KV heads must be at least 1"));
        }
        let heads_per_rank = (kv_heads / tp).max(1);
        let block_bytes = checked_mul(&[heads_per_rank, head_dim, dtype_bytes, tokens_per_block], "block bytes")?;
        Self {
            attention: Attention::Mha,
            layers,
            blocks,
            key_block_bytes: block_bytes,
            value_block_bytes: block_bytes,
            index_block_bytes: 0,
        }
        .checked()
    }

    /// An MLA cache (identical on every rank): a latent of `latent_dim`
    /// elements per token, and an index buffer of `index_dim` elements per
    /// token when non-zero.
    ///
    /// ```
    /// use kvring::kv::CacheShape;
    /// // DeepSeek-V3-like: 61 layers, latent 576 x bf16, 64-token blocks.
    /// let shape = CacheShape::mla(61, 1000, 576, 2, 64, 0).unwrap();
    /// assert_eq!(shape.key_block_bytes, 576 * 2 * 64);
    /// assert_eq!(shape.value_block_bytes, 0);
    /// ```
    pub fn mla(
        layers: u32,
        blocks: u64,
        latent_dim: u64,
        dtype_bytes: u64,
        tokens_per_block: u64,
        index_dim: u64,
    ) -> Result<Self> {
        let key = checked_mul(&[latent_dim, dtype_bytes, tokens_per_block], "block bytes")?;
        let index = checked_mul(&[index_dim, dtype_bytes, tokens_per_block], "block bytes")?;
        Self {
            attention: Attention::Mla,
            layers,
            blocks,
            key_block_bytes: key,
            value_block_bytes: 0,
            index_block_bytes: index,
        }
        .checked()
    }

    fn checked(self) -> Result<Self> {
        if self.layers == 0 || self.blocks == 0 || self.key_block_bytes == 0 {
            return Err(Error::invalid("cache shape", "layers, blocks and key bytes per block must be at least 1"));
        }
        if self.attention == Attention::Mha && self.value_block_bytes == 0 {
            return Err(Error::invalid("cache shape", "an MHA cache needs a value buffer"));
        }
        if self.attention == Attention::Mla && self.value_block_bytes != 0 {
            return Err(Error::invalid("cache shape", "an MLA cache has no value buffer"));
        }
        self.bytes()?;
        Ok(self)
    }

    /// The buffers of one layer: (kind, bytes per block), in layout order.
    pub fn kinds(&self) -> impl Iterator<Item = (RegionKind, u64)> + '_ {
        [
            (RegionKind::Key, self.key_block_bytes),
            (RegionKind::Value, self.value_block_bytes),
            (RegionKind::Index, self.index_block_bytes),
        ]
        .into_iter()
        .filter(|&(_, bytes)| bytes > 0)
    }

    /// Bytes of one layer (all its buffers).
    pub fn layer_bytes(&self) -> Result<u64> {
        self.kinds()
            .try_fold(0u64, |acc, (_, block_bytes)| {
                block_bytes.checked_mul(self.blocks).and_then(|b| acc.checked_add(b))
            })
            .ok_or_else(|| Error::invalid("cache shape", "layer size overflows 64 bits"))
    }

    /// Bytes of the whole cache.
    pub fn bytes(&self) -> Result<u64> {
        self.layer_bytes()?
            .checked_mul(self.layers as u64)
            .ok_or_else(|| Error::invalid("cache shape", "cache size overflows 64 bits"))
    }
}

/// Where every buffer of every layer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    shape: CacheShape,
    /// Per layer, its buffers in `CacheShape::kinds` order.
    layers: Vec<Vec<KvBuffer>>,
}

impl KvLayout {
    /// Places a cache in one region from `base`, layer after layer, each
    /// layer's buffers back to back (key, value, index).
    ///
    /// ```
    /// use kvring::kv::{CacheShape, KvLayout};
    /// let shape = CacheShape::mla(2, 4, 576, 2, 64, 0).unwrap();
    /// let layout = KvLayout::contiguous(shape, kvring::RegionId::new(0, 1), 0).unwrap();
    /// assert_eq!(layout.layer(1).unwrap()[0].offset, 4 * 576 * 2 * 64);
    /// ```
    pub fn contiguous(shape: CacheShape, region: RegionId, base: u64) -> Result<Self> {
        let shape = shape.checked()?;
        let mut offset = base;
        let mut layers = Vec::with_capacity(shape.layers as usize);
        for _ in 0..shape.layers {
            let mut buffers = Vec::with_capacity(3);
            for (kind, block_bytes) in shape.kinds() {
                buffers.push(KvBuffer { kind, region, offset, block_bytes });
                offset = block_bytes
                    .checked_mul(shape.blocks)
                    .and_then(|len| offset.checked_add(len))
                    .ok_or_else(|| Error::invalid("layout", "offsets overflow 64 bits"))?;
            }
            layers.push(buffers);
        }
        Ok(Self { shape, layers })
    }

    /// A layout from explicit buffers (e.g. one region per layer and kind,
    /// as engines that allocate a tensor per layer have). Every layer must
    /// hold exactly the shape's kinds, in order, with its bytes per block.
    pub fn from_buffers(shape: CacheShape, layers: Vec<Vec<KvBuffer>>) -> Result<Self> {
        let shape = shape.checked()?;
        if layers.len() != shape.layers as usize {
            return Err(Error::invalid(
                "layout",
                format!("{} layers given for a {}-layer shape", layers.len(), shape.layers),
            ));
        }
        for (index, buffers) in layers.iter().enumerate() {
            let expected: Vec<_> = shape.kinds().collect();
            let actual: Vec<_> = buffers.iter().map(|b| (b.kind, b.block_bytes)).collect();
            if expected != actual {
                return Err(Error::invalid(
                    "layout",
                    format!("layer {index} has buffers {actual:?}, the shape says {expected:?}"),
                ));
            }
            for buffer in buffers {
                buffer
                    .block_bytes
                    .checked_mul(shape.blocks)
                    .and_then(|len| buffer.offset.checked_add(len))
                    .ok_or_else(|| {
                        Error::invalid("layout", format!("layer {index} {:?} buffer overflows 64 bits", buffer.kind))
                    })?;
            }
        }
        Ok(Self { shape, layers })
    }

    /// The shape.
    pub fn shape(&self) -> &CacheShape {
        &self.shape
    }

    /// Number of layers.
    pub fn layers(&self) -> u32 {
        self.shape.layers
    }

    /// Blocks per buffer.
    pub fn blocks(&self) -> u64 {
        self.shape.blocks
    }

    /// One layer's buffers.
    pub fn layer(&self, layer: u32) -> Result<&[KvBuffer]> {
        self.layers
            .get(layer as usize)
            .map(Vec::as_slice)
            .ok_or(Error::LayerOutOfRange { layer, layers: self.shape.layers })
    }

    /// True when a buffer of some layer lies in `region`.
    pub fn names_region(&self, region: RegionId) -> bool {
        self.layers.iter().flatten().any(|buffer| buffer.region == region)
    }

    /// Refuses to exchange blocks with `remote` unless both layouts agree on
    /// attention, layer count, and every layer's buffer kinds and bytes per
    /// block; the error names the layer and the field.
    pub fn check_compatible(&self, remote: &KvLayout) -> Result<()> {
        let mismatch =
            |layer, field, local: String, remote: String| Err(Error::LayoutMismatch { layer, field, local, remote });
        if self.shape.attention != remote.shape.attention {
            return mismatch(
                None,
                "attention",
                format!("{:?}", self.shape.attention),
                format!("{:?}", remote.shape.attention),
            );
        }
        if self.shape.layers != remote.shape.layers {
            return mismatch(None, "layer count", self.shape.layers.to_string(), remote.shape.layers.to_string());
        }
        for (index, (mine, theirs)) in self.layers.iter().zip(&remote.layers).enumerate() {
            let layer = Some(index as u32);
            let kinds =
                |buffers: &[KvBuffer]| buffers.iter().map(|b| format!("{:?}", b.kind)).collect::<Vec<_>>().join("+");
            if mine.len() != theirs.len() || mine.iter().zip(theirs).any(|(a, b)| a.kind != b.kind) {
                return mismatch(layer, "buffer kinds", kinds(mine), kinds(theirs));
            }
            for (a, b) in mine.iter().zip(theirs) {
                if a.block_bytes != b.block_bytes {
                    let field = match a.kind {
                        RegionKind::Key => "key bytes per block",
                        RegionKind::Value => "value bytes per block",
                        RegionKind::Index => "index bytes per block",
                        RegionKind::Raw => "bytes per block",
                    };
                    return mismatch(layer, field, a.block_bytes.to_string(), b.block_bytes.to_string());
                }
            }
        }
        Ok(())
    }
}

/// Most layers a layout received from a peer may have (bounds the message).
pub const MAX_LAYERS: u32 = 4096;

impl KvLayout {
    /// The wire form.
    pub fn to_proto(&self) -> proto::KvLayoutInfo {
        let s = &self.shape;
        proto::KvLayoutInfo {
            attention: match s.attention {
                Attention::Mha => proto::KvAttention::Mha as i32,
                Attention::Mla => proto::KvAttention::Mla as i32,
            },
            layers: s.layers,
            blocks: s.blocks,
            key_block_bytes: s.key_block_bytes,
            value_block_bytes: s.value_block_bytes,
            index_block_bytes: s.index_block_bytes,
            buffers: self
                .layers
                .iter()
                .flatten()
                .map(|b| proto::KvBufferInfo {
                    kind: b.kind.to_proto() as i32,
                    region: b.region.raw(),
                    offset: b.offset,
                    block_bytes: b.block_bytes,
                })
                .collect(),
        }
    }

    /// Checks and converts a layout a peer sent.
    pub fn from_proto(info: proto::KvLayoutInfo) -> Result<Self> {
        let bad = |reason: String| Error::malformed("KV layout", reason);
        let attention = match proto::KvAttention::try_from(info.attention) {
            Ok(proto::KvAttention::Mha) => Attention::Mha,
            Ok(proto::KvAttention::Mla) => Attention::Mla,
            Err(_) => return Err(bad(format!("unknown attention {}", info.attention))),
        };
        if info.layers > MAX_LAYERS {
            return Err(bad(format!("{} layers exceeds the limit of {MAX_LAYERS}", info.layers)));
        }
        let shape = CacheShape {
            attention,
            layers: info.layers,
            blocks: info.blocks,
            key_block_bytes: info.key_block_bytes,
            value_block_bytes: info.value_block_bytes,
            index_block_bytes: info.index_block_bytes,
        }
        .checked()
        .map_err(|e| bad(e.to_string()))?;
        let kinds = shape.kinds().count();
        if info.buffers.len() != kinds * shape.layers as usize {
            return Err(bad(format!("{} buffers for {} layers of {kinds} kinds", info.buffers.len(), shape.layers)));
        }
        let mut buffers = info.buffers.into_iter();
        let mut layers = Vec::with_capacity(shape.layers as usize);
        for _ in 0..shape.layers {
            let mut layer = Vec::with_capacity(kinds);
            for b in buffers.by_ref().take(kinds) {
                let kind =
                    proto::RegionKind::try_from(b.kind).map_err(|_| bad(format!("unknown buffer kind {}", b.kind)))?;
                layer.push(KvBuffer {
                    kind: RegionKind::from_proto(kind),
                    region: RegionId::from_raw(b.region),
                    offset: b.offset,
                    block_bytes: b.block_bytes,
                });
            }
            layers.push(layer);
        }
        KvLayout::from_buffers(shape, layers).map_err(|e| bad(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region() -> RegionId {
        RegionId::new(1, 1)
    }

    #[test]
    fn mha_shards_kv_heads_and_replicates_below_one_head_per_rank() {
        let tp1 = CacheShape::mha(32, 10, 8, 128, 2, 16, 1).unwrap();
        let tp8 = CacheShape::mha(32, 10, 8, 128, 2, 16, 8).unwrap();
        let tp16 = CacheShape::mha(32, 10, 8, 128, 2, 16, 16).unwrap();
        assert_eq!(tp1.key_block_bytes, 8 * tp8.key_block_bytes);
        assert_eq!(tp16.key_block_bytes, tp8.key_block_bytes, "one head per rank at least");
        assert_eq!(tp1.kinds().map(|(k, _)| k).collect::<Vec<_>>(), [RegionKind::Key, RegionKind::Value]);
    }

    #[test]
    fn mla_has_latent_and_maybe_index_but_no_value() {
        let plain = CacheShape::mla(61, 10, 576, 2, 64, 0).unwrap();
        assert_eq!(plain.kinds().map(|(k, _)| k).collect::<Vec<_>>(), [RegionKind::Key]);
        let indexed = CacheShape::mla(61, 10, 576, 2, 64, 128).unwrap();
        assert_eq!(indexed.kinds().map(|(k, _)| k).collect::<Vec<_>>(), [RegionKind::Key, RegionKind::Index]);
    }

    #[test]
    fn sizes_that_overflow_are_errors() {
        assert!(CacheShape::mla(61, 10, u64::MAX, 2, 64, 0).unwrap_err().to_string().contains("overflows"));
        assert!(CacheShape::mla(61, u64::MAX / 2, 576, 2, 64, 0).unwrap_err().to_string().contains("overflows"));
        assert!(CacheShape::mha(4, 10, 8, 128, 2, 16, 0).is_err());
        let shape = CacheShape::mla(2, 4, 576, 2, 64, 0).unwrap();
        assert!(KvLayout::contiguous(shape, region(), u64::MAX - 10).unwrap_err().to_string().contains("overflow"));
    }

    #[test]
    fn mismatches_name_the_layer_and_the_field() {
        let a = KvLayout::contiguous(CacheShape::mha(4, 10, 8, 128, 2, 16, 1).unwrap(), region(), 0).unwrap();
        let fewer = KvLayout::contiguous(CacheShape::mha(3, 10, 8, 128, 2, 16, 1).unwrap(), region(), 0).unwrap();
        let other_tp = KvLayout::contiguous(CacheShape::mha(4, 10, 8, 128, 2, 16, 2).unwrap(), region(), 0).unwrap();
        let mla = KvLayout::contiguous(CacheShape::mla(4, 10, 576, 2, 64, 0).unwrap(), region(), 0).unwrap();
        assert!(a.check_compatible(&a).is_ok());
        let err = a.check_compatible(&fewer).unwrap_err().to_string();
        assert_eq!(err, "KV layouts differ in layer count: local 4, remote 3");
        let err = a.check_compatible(&other_tp).unwrap_err().to_string();
        assert_eq!(err, "KV layouts differ at layer 0, key bytes per block: local 32768, remote 16384");
        assert!(a.check_compatible(&mla).unwrap_err().to_string().contains("attention"));
        // One layer with a different index buffer.
        let indexed = CacheShape::mla(2, 4, 576, 2, 64, 64).unwrap();
        let plain = CacheShape::mla(2, 4, 576, 2, 64, 0).unwrap();
        let mut layers = KvLayout::contiguous(indexed, region(), 0).unwrap().layers;
        layers[1][1].block_bytes = 2 * 64 * 32;
        let mut shape_b = indexed;
        shape_b.index_block_bytes = 2 * 64 * 64;
        let a = KvLayout::contiguous(indexed, region(), 0).unwrap();
        let b = KvLayout { shape: shape_b, layers };
        assert_eq!(
            a.check_compatible(&b).unwrap_err().to_string(),
            "KV layouts differ at layer 1, index bytes per block: local 8192, remote 4096"
        );
        let c = KvLayout::contiguous(plain, region(), 0).unwrap();
        assert_eq!(
            a.check_compatible(&c).unwrap_err().to_string(),
            "KV layouts differ at layer 0, buffer kinds: local Key+Index, remote Key"
        );
    }

    #[test]
    fn layouts_round_trip_and_hostile_ones_are_refused() {
        for shape in [CacheShape::mha(3, 8, 8, 128, 2, 16, 2).unwrap(), CacheShape::mla(2, 4, 576, 2, 64, 64).unwrap()]
        {
            let layout = KvLayout::contiguous(shape, region(), 4096).unwrap();
            assert_eq!(KvLayout::from_proto(layout.to_proto()).unwrap(), layout);
        }
        let good = KvLayout::contiguous(CacheShape::mla(2, 4, 576, 2, 64, 0).unwrap(), region(), 0).unwrap().to_proto();
        let mut p = good.clone();
        p.buffers.pop();
        assert!(KvLayout::from_proto(p).unwrap_err().to_string().contains("1 buffers for 2 layers"));
        let mut p = good.clone();
        p.attention = 7;
        assert!(KvLayout::from_proto(p).unwrap_err().to_string().contains("unknown attention"));
        let mut p = good.clone();
        p.layers = MAX_LAYERS + 1;
        assert!(KvLayout::from_proto(p).unwrap_err().to_string().contains("exceeds the limit"));
        let mut p = good.clone();
        p.buffers[1].offset = u64::MAX;
        assert!(KvLayout::from_proto(p).unwrap_err().to_string().contains("overflows"));
        let mut p = good;
        p.value_block_bytes = 5;
        assert!(KvLayout::from_proto(p).unwrap_err().to_string().contains("no value buffer"));
    }

    #[test]
    fn explicit_buffers_must_match_the_shape() {
        let shape = CacheShape::mla(1, 4, 576, 2, 64, 0).unwrap();
        let good =
            vec![vec![KvBuffer { kind: RegionKind::Key, region: region(), offset: 0, block_bytes: 576 * 2 * 64 }]];
        assert!(KvLayout::from_buffers(shape, good.clone()).is_ok());
        let mut bad = good.clone();
        bad[0][0].block_bytes = 1;
        assert!(KvLayout::from_buffers(shape, bad).is_err());
        assert!(KvLayout::from_buffers(shape, vec![]).unwrap_err().to_string().contains("0 layers given"));
    }
}
