"""Generate a tiny Llama model offline: random weights, a real byte-level BPE tokenizer.

Tests, CI and `corral up` without `--model` need a model that both transformers and vLLM load,
on a machine with no network and no GPU. Its weights are random (its text is gibberish), but it
has the real architecture, a real tokenizer that encodes any UTF-8 text, and a chat template, so
every code path of a real deployment runs. Greedy decoding is deterministic, which is what
migration correctness checks need.

    corral make-model DIR [--seed N] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-llama"
TOKENIZER_VOCAB_SIZE = 384
# Files whose presence means a directory already holds a complete model.
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, *ROLE_TOKENS)

# Zephyr-style: one role token per turn, each turn closed by the end-of-sequence token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Training text for the BPE merges. Byte-level BPE encodes any UTF-8 text whatever the corpus;
# the corpus only decides which byte sequences become single tokens.
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Large language models generate text one token at a time.",
    "A request waits in the queue until the scheduler finds free memory for it.",
    "Live migration moves a running request to another instance without stopping it.",
    "The key-value cache grows by one block every sixteen tokens.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    '{"model": "tiny-llama", "max_tokens": 128, "stream": true}',
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Große Sprachmodelle erzeugen Text Wort für Wort.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "Les modèles de langage génèrent du texte très rapidement.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "¿Dónde está la estación de tren? Está cerca de aquí.",
    "A raposa marrom rápida pula sobre o cão preguiçoso.",
    "La volpe marrone veloce salta sopra il cane pigro.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "Привет, мир! Как дела?",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "大型语言模型一次生成一个词。",
    "你好，世界！今天天气很好。",
    "素早い茶色の狐がのろまな犬を飛び越える。",
    "こんにちは、世界！お元気ですか？",
    "빠른 갈색 여우가 게으른 개를 뛰어넘는다.",
    "안녕하세요, 세계!",
    "الثعلب البني السريع يقفز فوق الكلب الكسول.",
    "השועל החום המהיר קופץ מעל הכלב העצלן.",
    "तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है।",
    "Hızlı kahverengi tilki tembel köpeğin üzerinden atlar.",
    "Con cáo nâu nhanh nhẹn nhảy qua con chó lười.",
    "Emoji: 😀 🚀 🦊 🐶 ❤️ 👍🏽 🇺🇳",
    "Math: ∑ x² = ∫ f(x) dx ≈ π ≠ ∞",
    "user: What is the capital of France? assistant: Paris.",
)


def default_model_dir() -> Path:
    """Where `corral up` keeps its generated model: `$CORRAL_HOME` or `~/.cache/corral`."""
    home = os.environ.get("CORRAL_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "corral"
    return base / DEFAULT_MODEL_NAME


def is_model_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in MODEL_FILES)


def build_tokenizer():
    """A byte-level BPE trained on CORPUS, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Like Llama: encoding a text prepends <s>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def build_config(tokenizer, *, hidden_size: int, num_layers: int, max_position_embeddings: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        # Wider than the usual 0.02 so logits are peaked: greedy picks stay clear of float noise
        # across batch compositions.
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )


def build_model(config, seed: int):
    """Random weights from `seed`, without disturbing the caller's global torch RNG."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


@contextlib.contextmanager
def progress_bars_off():
    """Saving a 1.6 MB model needs no progress bar on stderr."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only files; a model directory is shared like any other."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def write_model(
    out_dir: Path, *, seed: int, hidden_size: int, num_layers: int, max_position_embeddings: int
) -> None:
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    config = build_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        max_position_embeddings=max_position_embeddings,
    )
    model = build_model(config, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    with progress_bars_off():
        model.save_pretrained(out_dir)
        # The chat template goes into tokenizer_config.json, which every transformers version reads.
        tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    make_readable(out_dir)


def make_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    *,
    force: bool = False,
    hidden_size: int = 128,
    num_layers: int = 2,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write the tiny model to `out_dir` and return its path. Same seed, same files.

    Built in a temporary sibling directory and renamed into place, so a crash or a concurrent
    caller never sees a half-written model.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if hidden_size < 16 or hidden_size % 16:
        raise ValueError(f"hidden size must be a positive multiple of 16 (4 heads), got {hidden_size}")
    if num_layers < 1:
        raise ValueError(f"the model needs at least one layer, got {num_layers}")
    out_dir = Path(out_dir).expanduser().resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty (use --force to overwrite)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write_model(
            staging,
            seed=seed,
            hidden_size=hidden_size,
            num_layers=num_layers,
            max_position_embeddings=max_position_embeddings,
        )
        if out_dir.exists():
            if force:
                shutil.rmtree(out_dir)
            else:
                out_dir.rmdir()  # empty when checked; OSError if a concurrent maker filled it since
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def ensure_tiny_model(path: str | Path | None = None, seed: int = 0) -> Path:
    """The tiny model at `path` (default: `default_model_dir()`), generated on first use."""
    target = Path(path).expanduser().resolve() if path else default_model_dir()
    if is_model_dir(target):
        return target
    try:
        return make_tiny_model(target, seed=seed)
    except OSError:  # FileExistsError included
        # Another process may have finished the same model between our check and our rename.
        if is_model_dir(target):
            return target
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    # Larger variants make the KV cache (and so a migration's transfer) bigger: KV bytes per token
    # = layers x 2 x 2 KV heads x hidden/4 x 4 bytes (1 KiB by default; 16 KiB at 512 and 8).
    parser.add_argument("--hidden-size", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument("--num-layers", type=int, default=2, help="decoder layers (default 2)")


def run(args: argparse.Namespace) -> int:
    try:
        path = make_tiny_model(args.dir, seed=args.seed, force=args.force, hidden_size=args.hidden_size,
                               num_layers=args.num_layers)
    except (OSError, ValueError) as error:
        print(f"corral make-model: {error}", file=sys.stderr)
        return 1
    print(f"wrote tiny Llama model to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral make-model", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
