"""Builds a tiny Llama for the vLLM checks, on this machine, from nothing.

Seeded random weights (transformers' own initialisation, scaled so greedy
decoding is not a near-tie) and a word-level tokenizer built with
``tokenizers``: no hub, no download. Two seeds give two models of the same
shape, for the negative control (prefill with other weights).

    python make_model.py OUT_DIR --seed 1
"""

import argparse
import json
import os

VOCAB_WORDS = 508  # + 4 special tokens = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tokenizer(out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out_dir)
    return len(vocab)


def build_model(out_dir, seed, vocab_size):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    # No end-of-sequence by sampling: every request runs to max_tokens, so
    # outputs of different lengths never hide a mismatch.
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    vocab_size = build_tokenizer(args.out_dir)
    build_model(args.out_dir, args.seed, vocab_size)
    print(f"tiny llama (seed {args.seed}, vocab {vocab_size}) in {args.out_dir}")


if __name__ == "__main__":
    main()
