"""Build a tiny Qwen2 causal LM and a byte-level tokenizer, fully offline.

Token ids 0..255 are the raw bytes (GPT-2 byte-to-unicode alphabet, so id == byte value),
followed by three specials: ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>``
(end of a chat turn, the EOS a generation stops on). The chat template is compact:
``<|im_start|>{role initial}{content}<|im_end|>`` (see CHAT_TEMPLATE). Both transformers
and vLLM load the directory as any other Qwen2 checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
PAD_ID, IM_START_ID, IM_END_ID = 256, 257, 258
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Compact chat template: one special token opens a turn, one letter names the role
# (s/u/a/t = system/user/assistant/tool), <|im_end|> closes it. A two-digit addition is
# ~14 tokens instead of ~45 with Qwen's "<|im_start|>user\n...<|im_end|>\n" template, which
# makes the CPU demo's SFT and RL ~3x cheaper; multi-turn and roles still work.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'][0] + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>a' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 1024


SIZES: dict[str, TinySize] = {
    # ~0.2M parameters: unit and integration tests.
    "tiny": TinySize(128, 256, 2, 4, 2),
    # ~2.4M parameters: the demo and benchmarks (learns two-digit addition after SFT).
    "small": TinySize(256, 512, 4, 4, 2),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer() -> Any:  # a tokenizers.Tokenizer
    # where used: `ludic model --help` (and the tests' token constants) load no tokenizers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.token_to_id(PAD_TOKEN) == PAD_ID and tok.token_to_id(IM_END) == IM_END_ID
    return tok


def save_tokenizer(out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in zip((PAD_ID, IM_START_ID, IM_END_ID), SPECIAL_TOKENS)
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": IM_END, "pad_token": PAD_TOKEN}, indent=2)
    )


def init_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a randomly initialised (seeded) Qwen2 model and its tokenizer to ``out_dir``."""
    import torch  # torch and transformers where used, as build_tokenizer's import
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    s = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        max_position_embeddings=s.max_position_embeddings,
        max_window_layers=s.num_hidden_layers,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=[IM_END_ID, PAD_ID], pad_token_id=PAD_ID, bos_token_id=None
    )
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    return out


def encode_bytes(text: str) -> list[int]:
    """Token ids of plain text (no specials): the UTF-8 bytes."""
    return list(text.encode("utf-8"))
