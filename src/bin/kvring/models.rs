//! KV-cache presets for `kvring bench --kv` and `kvring serve --kv`.

use kvring::kv::CacheShape;

/// A model preset: how its per-rank cache is shaped.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    /// Name on the command line.
    pub name: &'static str,
    /// Tokens per block.
    pub tokens_per_block: u64,
    shape: fn(blocks: u64) -> kvring::Result<CacheShape>,
}

impl Model {
    /// The cache shape holding `blocks` blocks.
    pub fn shape(&self, blocks: u64) -> Result<CacheShape, String> {
        (self.shape)(blocks).map_err(|e| e.to_string())
    }
}

/// The presets.
pub const MODELS: [Model; 2] = [
    // DeepSeek-V3-like MLA: 61 layers, latent 576 x bf16 per token, 64-token blocks.
    Model { name: "deepseek-v3", tokens_per_block: 64, shape: |blocks| CacheShape::mla(61, blocks, 576, 2, 64, 0) },
    // Llama-3-8B-like GQA: 32 layers, 8 KV heads x 128 x bf16, key and value, 16-token blocks, tp 1.
    Model { name: "llama3-8b", tokens_per_block: 16, shape: |blocks| CacheShape::mha(32, blocks, 8, 128, 2, 16, 1) },
];

/// Looks a preset up by name.
pub fn find(name: &str) -> Result<Model, String> {
    MODELS.iter().copied().find(|m| m.name == name).ok_or_else(|| {
        let known: Vec<_> = MODELS.iter().map(|m| m.name).collect();
        format!("unknown model {name:?} (presets: {})", known.join(", "))
    })
}
