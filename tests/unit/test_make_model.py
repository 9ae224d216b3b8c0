"""The tiny Llama generator: loads with transformers, a byte-level tokenizer, deterministic weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.tools import make_model
from services.tools.make_model import ensure_tiny_model, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_config_describes_the_tiny_llama(model_dir, tokenizer):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 128)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["max_position_embeddings"] == 4096
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] == len(tokenizer)
    assert 256 < config["vocab_size"] <= 512
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["bos_token_id"] == config["bos_token_id"] == tokenizer.bos_token_id
    assert generation["eos_token_id"] == config["eos_token_id"] == tokenizer.eos_token_id


def test_model_loads_and_generates_with_transformers(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    prompt = torch.tensor([tokenizer.encode("Hello, world!")])
    output = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert output.shape == (1, prompt.shape[1] + 5)
    assert int(output.max()) < len(tokenizer)


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "  spaces   and\ttabs\nnew lines . , ",
        "emoji 😀🚀🦊 and a family 👨‍👩‍👧",
        "中文，日本語、한국어 — never seen: ꦱꦸꦒꦼꦁ",
        "",
    ],
)
def test_tokenizer_round_trips_any_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_bpe_merges_shorten_corpus_text(tokenizer):
    for text in ("The quick brown fox", "大型语言模型"):
        assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text.encode())


def test_chat_template_applies(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi 👋</s>\n<|assistant|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.eos_token_id) == 2
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") in ids


def test_chat_template_is_stored_in_tokenizer_config(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|assistant|>" in config["chat_template"]


def test_same_seed_writes_identical_files(model_dir, tmp_path):
    again = make_tiny_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert file_digest(again / name) == file_digest(model_dir / name), name


def test_other_seed_writes_other_weights(model_dir, tmp_path):
    other = load_file(make_tiny_model(tmp_path / "other", seed=1) / "model.safetensors")
    base = load_file(model_dir / "model.safetensors")
    assert other.keys() == base.keys()
    assert not torch.equal(other["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_generation_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model(tmp_path / "model", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_refuses_a_non_empty_directory_without_force(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="--force"):
        make_tiny_model(tmp_path, seed=0)
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_force_replaces_the_directory(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    make_tiny_model(target, seed=0, force=True)
    assert not (target / "stale.txt").exists()
    assert (target / "model.safetensors").is_file()


def test_ensure_makes_the_model_once(tmp_path):
    target = tmp_path / "cache" / "tiny-llama"
    assert ensure_tiny_model(target) == target
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_location_follows_corral_home(monkeypatch, tmp_path):
    monkeypatch.setenv("CORRAL_HOME", str(tmp_path))
    assert make_model.default_model_dir() == tmp_path / "tiny-llama"
    monkeypatch.delenv("CORRAL_HOME")
    assert make_model.default_model_dir() == Path.home() / ".cache" / "corral" / "tiny-llama"


def test_cli_writes_the_model_and_refuses_to_overwrite(tmp_path, capsys):
    target = tmp_path / "cli-model"
    assert make_model.main([str(target), "--seed", "3"]) == 0
    assert (target / "tokenizer.json").is_file()
    assert make_model.main([str(target)]) == 1
    assert "--force" in capsys.readouterr().err
    assert make_model.main([str(target), "--force"]) == 0


def test_cli_rejects_a_negative_seed(tmp_path, capsys):
    assert make_model.main([str(tmp_path / "m"), "--seed", "-1"]) == 1
    assert "seed" in capsys.readouterr().err


def test_the_cli_writes_a_larger_model_for_bigger_kv(tmp_path):
    assert make_model.main([str(tmp_path / "wide"), "--hidden-size", "64", "--num-layers", "3"]) == 0
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 3)


@pytest.mark.parametrize("flags, reason", [(["--hidden-size", "100"], "multiple of 16"),
                                           (["--num-layers", "0"], "at least one layer")])
def test_the_cli_refuses_a_model_shape_it_cannot_build(tmp_path, capsys, flags, reason):
    assert make_model.main([str(tmp_path / "bad"), *flags]) == 1
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
