"""The model and its paged KV cache, shared by the prefill and decode workers.

The models are transformers' own ``LlamaForCausalLM`` (grouped-query
attention) and ``DeepseekV3ForCausalLM`` (MLA), built from small configs with
seeded weights: nothing is fetched from a hub. The cache is vLLM's shape:
16-token blocks, one pool per layer, a block table per request; the pools of
all layers are views of one tensor, so an engine registers it once.

Byte layout of that tensor (kvring's ``KvLayout::contiguous``: per layer, the
key pool then the value pool, each ``blocks x block_bytes``):

- Llama: ``[layers, 2 (K, V), blocks, kv_heads, 16 tokens, head_dim]``
  (head-major inside a block, "HND", as vLLM's NIXL connector lays blocks
  out for heterogeneous TP: a rank's share of the heads is one run per
  block, so kvring's head-sliced plan moves one descriptor per block;
  ``kv_heads`` is this rank's share)
- MLA:   ``[layers, blocks, 16 tokens, kv_lora_rank + qk_rope_head_dim]``
  (one latent per token and layer, as xLLM moves it: the normalised
  compressed KV and the rotated shared key, which is exactly what
  transformers' DeepSeek-V3 attention caches).
"""

import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402

BLOCK_TOKENS = 16
SEED = 1234


def device():
    """Where the models and pools live: ``PD_DEVICE``, "cpu" (the default)
    or "cuda" (run.py's ``--device`` sets it; the workers it spawns inherit
    it). CUDA has not run here: docs/PD.md."""
    return torch.device(os.environ.get("PD_DEVICE", "cpu"))


def deterministic():
    """One thread and deterministic kernels, so tokens compare exactly."""
    if device().type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace (PyTorch's
        # "Reproducibility" notes), read when its handle is made.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()


def model_config(kind):
    """(config, model class) of ``kind``."""
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "llama-fig":  # larger, for the figures: more KV per layer
        config = transformers.LlamaConfig(
            vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "mla":
        config = transformers.DeepseekV3Config(
            vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
            max_position_embeddings=1024, tie_word_embeddings=False,
        )
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"unknown model {kind!r}")
    return config, cls


def kv_heads(kind):
    """KV heads of ``kind`` when its cache is split by head (None: MLA)."""
    cfg, _ = model_config(kind)
    return None if hasattr(cfg, "kv_lora_rank") else cfg.num_key_value_heads


def build(kind):
    """The model ``kind`` ("llama" or "mla"), float32, eager attention, with
    weights drawn from a generator seeded with ``SEED`` (identical in every
    process)."""
    deterministic()
    config, cls = model_config(kind)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = cls(config).eval()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.08 if kind == "mla" else 0.15, generator=generator)
        for name, buf in sorted(model.named_buffers()):
            if "e_score_correction_bias" in name:
                buf.zero_()
    return model.to(device())  # drawn on the CPU: the same weights on every device


def forward(model, cache, **inputs):
    """``model(**inputs)`` over ``cache``. transformers 5.19's causal LMs
    take the cache as ``past_key_values`` and silently ignore an unknown
    ``cache=`` keyword (the model then runs with no past at all); the name
    is read from the model's own signature, so a version that calls it
    ``cache`` works too."""
    params = inspect.signature(model.forward).parameters
    name = "past_key_values" if "past_key_values" in params else "cache"
    return model(**inputs, **{name: cache}, use_cache=True)


def prompts(count, lengths, seed=7):
    """``count`` prompts of the given lengths (cycled), token ids < 2048."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2048, (lengths[i % len(lengths)],), generator=generator).tolist() for i in range(count)]


def reference(model, prompt, new_tokens):
    """transformers' own greedy ``generate`` in this process: the referee."""
    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
        pad_token_id=0, bos_token_id=None,
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), generation_config=config)
    return out[0, len(prompt):].tolist()


class PoolSpec:
    """Shape of one engine's pools for ``model``, with ``kv_heads`` of its
    KV heads (a tensor-parallel rank's share; all of them for MLA)."""

    def __init__(self, model, blocks, tp=1):
        config = model.config
        self.layers = config.num_hidden_layers
        self.blocks = blocks
        self.mla = hasattr(config, "kv_lora_rank")
        self.tp = tp
        if self.mla:
            self.latent = config.kv_lora_rank
            self.rope = config.qk_rope_head_dim
            self.shape = (self.layers, blocks, BLOCK_TOKENS, self.latent + self.rope)
            self.block_bytes = BLOCK_TOKENS * (self.latent + self.rope) * 4
            self.kinds = 1
        else:
            self.kv_heads_total = config.num_key_value_heads
            if self.kv_heads_total % tp:
                raise ValueError(f"{self.kv_heads_total} KV heads do not split over tp {tp} in this example")
            self.kv_heads = self.kv_heads_total // tp
            self.head_dim = config.head_dim
            self.shape = (self.layers, 2, blocks, self.kv_heads, BLOCK_TOKENS, self.head_dim)
            self.block_bytes = BLOCK_TOKENS * self.kv_heads * self.head_dim * 4
            self.kinds = 2

    def layout(self):
        """(attention, dims) for ``Engine.set_kv_layout``."""
        if self.mla:
            return "mla", [self.layers, self.blocks, self.latent + self.rope, 4, BLOCK_TOKENS, 0]
        return "mha", [self.layers, self.blocks, self.kv_heads_total, self.head_dim, 4, BLOCK_TOKENS, self.tp]

    def heads(self):
        """(kv_heads, head_bytes, tokens_per_block, order) for
        ``Engine.push_layer_heads_tagged``."""
        return (self.kv_heads_total, self.head_dim * 4, BLOCK_TOKENS, "hnd")

    def allocate(self):
        """The pools: one zeroed float32 tensor the model process owns."""
        return torch.zeros(self.shape, dtype=torch.float32, device=device())

    def block_offset(self, layer, kind, block):
        """Byte offset of (layer, kind, block) in the pools tensor."""
        return ((layer * self.kinds + kind) * self.blocks + block) * self.block_bytes


class BlockAllocator:
    """A free list of block ids, as vLLM's block manager keeps."""

    def __init__(self, blocks):
        self.free = list(range(blocks))

    def take(self, tokens):
        """Enough blocks for ``tokens`` tokens, or MemoryError."""
        need = -(-tokens // BLOCK_TOKENS)
        if need > len(self.free):
            raise MemoryError(f"{need} blocks wanted, {len(self.free)} free")
        taken, self.free = self.free[:need], self.free[need:]
        return taken

    def give_back(self, blocks):
        """Freed blocks go first in line: the next request reuses them (the
        case where a late write would do harm)."""
        self.free = list(blocks) + self.free


class PagedLayer(CacheLayerMixin):
    """One layer of a request's cache, stored in the paged pool.

    ``update`` writes the new tokens' K/V (or latent) at their positions in
    the request's blocks, then returns the whole sequence gathered from the
    pool: the model reads its cache from the pool, never from a copy.
    ``heads`` selects this rank's share of KV heads (tensor parallelism
    without splitting the matmuls: each rank stores and moves only its
    heads; the attention itself is given all of them, see ``gather``).
    ``after_write(layer)`` runs once the layer's new entries are in the
    pool (prefill: hand the layer to the pusher); ``before_read(layer)``
    runs before the pool is read (decode: wait until the layer landed).
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, cache, layer):
        super().__init__()
        self.cache = cache
        self.layer = layer
        self.length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        cache, spec = self.cache, self.cache.spec
        new = key_states.shape[-2]
        positions = torch.arange(self.length, self.length + new, device=cache.pools.device)
        blocks = torch.tensor(cache.block_table, device=cache.pools.device)[positions // BLOCK_TOKENS]
        slots = positions % BLOCK_TOKENS
        if cache.before_read is not None:
            cache.before_read(self.layer)
        if spec.mla:
            pool = cache.pools[self.layer]
            pool[blocks, slots, : spec.latent] = key_states[0, 0]
            pool[blocks, slots, spec.latent:] = value_states[0, 0]
        else:
            pool_k, pool_v = cache.pools[self.layer, 0], cache.pools[self.layer, 1]
            for heads, offset in cache.parts:
                pool_k[blocks + offset, :, slots] = key_states[0, heads].transpose(0, 1)
                pool_v[blocks + offset, :, slots] = value_states[0, heads].transpose(0, 1)
        self.length += new
        if cache.after_write is not None:
            cache.after_write(self.layer)
        return cache.gather(self.layer, self.length, key_states, value_states)

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1


class PagedCache(Cache):
    """A request's cache over the shared pools, through its block table."""

    def __init__(self, spec, pools, block_table, length=0, heads=None, parts=None, after_write=None, before_read=None):
        """``heads``: the model's KV heads this (prefill) rank stores, in
        pool order (its tensor-parallel share). ``parts``: where a decode
        rank keeps which heads, ``[(model heads, block id offset)]`` in
        head order (a tensor-parallel decode rank's own share at offset 0,
        the share it gathered from its peer further on)."""
        self.spec, self.pools, self.block_table = spec, pools, list(block_table)
        self.store_only = heads is not None
        self.parts = parts if parts is not None else [(heads if heads is not None else slice(None), 0)]
        self.after_write, self.before_read = after_write, before_read
        super().__init__(layers=[PagedLayer(self, layer) for layer in range(spec.layers)])
        for layer in self.layers:
            layer.length = length

    def gather(self, layer, length, key_states, value_states):
        """The layer's first ``length`` positions, from the pool, in the
        model's [batch, heads, seq, dim] shape."""
        spec = self.spec
        positions = torch.arange(length, device=self.pools.device)
        blocks = torch.tensor(self.block_table, device=self.pools.device)[positions // BLOCK_TOKENS]
        slots = positions % BLOCK_TOKENS
        if spec.mla:
            latent = self.pools[layer][blocks, slots]
            return latent[None, None, :, : spec.latent], latent[None, None, :, spec.latent:]
        pool_k, pool_v = self.pools[layer, 0], self.pools[layer, 1]
        keys = torch.cat([pool_k[blocks + offset, :, slots] for _, offset in self.parts], dim=1)
        values = torch.cat([pool_v[blocks + offset, :, slots] for _, offset in self.parts], dim=1)
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if self.store_only:
            # A tensor-parallel prefill rank stores and pushes only its share
            # of KV heads, but this example does not split the matmuls: it
            # runs every head's attention on the whole prompt (no past), so
            # the model's own states are the rest of the sequence.
            if length != key_states.shape[-2]:
                raise RuntimeError("a rank holding part of the KV heads can only prefill")
            return key_states, value_states
        return keys, values

