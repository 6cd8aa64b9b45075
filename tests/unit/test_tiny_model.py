"""`ludic model init` output loads in transformers and generates."""

import json

import torch

from libludic.models.tiny import IM_END_ID, PAD_ID, encode_bytes
from services.cli import main as ludic_main


def test_model_init_loads_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "m"
    assert ludic_main(["model", "init", str(out), "--size", "tiny", "--seed", "1"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["model_type"] == "qwen2" and cfg["hidden_size"] == 128 and cfg["num_hidden_layers"] == 2
    )
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    # byte-level: ids are the UTF-8 bytes, specials after 255
    assert (
        tok("ab+é", add_special_tokens=False)["input_ids"]
        == encode_bytes("ab+é")
        == [97, 98, 43, 195, 169]
    )
    assert tok.eos_token_id == IM_END_ID and tok.pad_token_id == PAD_ID
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>u1+1=<|im_end|><|im_start|>a"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > ids.shape[1]
    assert tok.decode(tok("hello\n", add_special_tokens=False)["input_ids"]) == "hello\n"


def test_model_init_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    from libludic.models.tiny import init_model

    a = load_file(init_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(init_model(tmp_path / "b", seed=3) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_unknown_command_and_size(capsys):
    assert ludic_main(["nope"]) == 2
    import pytest

    with pytest.raises(SystemExit):
        ludic_main(["model", "init", "x", "--size", "huge"])
