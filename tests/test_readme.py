"""Every Python block of the README, and of the trainer guides beside their code
(``tpo_kernels/integrations/{trl,verl}/README.md``), runs alone, as written, in a fresh process.

A block's info string names what it needs beyond the package, and such a block runs with a local
substitute: ``python trl`` (TRL and a model from the hub) with a tiny model saved locally and one
optimizer step on CPU; ``python distributed`` (torchrun) in one process with the gloo backend and
a 1 x 1 device mesh on CPU. ``python trl-offline`` (TRL on the package's tiny model) runs as
written, with the hub switched off (``HF_HUB_OFFLINE=1``, as every block). Whether a block runs
here is decided from the libraries its info string declares (``REQUIRES``), not from its imports:
a block whose declared libraries are not all installed is skipped, naming them; a plain
``python`` block must run with the package alone.
"""

import ast
import importlib.machinery
import importlib.util
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

import tpo_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README links to a guide beside each integration's code; their blocks are held to the same rules.
GUIDES = (ROOT / "tpo_kernels" / "integrations" / "trl" / "README.md",
          ROOT / "tpo_kernels" / "integrations" / "verl" / "README.md")


def _python_blocks(path: pathlib.Path) -> list:
    """(document, info-string tail, code) of each ```python block of ``path``."""
    if not path.is_file():
        return []
    document = path.relative_to(ROOT).as_posix()
    return [(document, kind, code)
            for kind, code in re.findall(r"^```python( [a-z-]+)?\n(.*?)^```", path.read_text(), re.S | re.M)]


README_BLOCKS = _python_blocks(README)
BLOCKS = README_BLOCKS + [block for guide in GUIDES for block in _python_blocks(guide)]


def _block_id(index_block):
    index, (document, kind, code) = index_block
    first = next(line for line in code.splitlines() if line.strip() and not line.startswith(("import", "from")))
    where = "README" if document == "README.md" else document.split("/")[-2] + "-guide"
    return f"{where}-{index}-{kind.strip() or 'python'}-{re.sub(r'[^A-Za-z0-9]+', '_', first)[:24]}"


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ)  # the child imports the tpo_kernels this test imported (tree or installed)
    package_parent = str(pathlib.Path(tpo_kernels.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env, timeout=900)


# What a block of each info string needs to run here, beyond the package and its requirements (the
# [test] extra's included): for ``trl``, the script's own libraries and those of the local stand-in
# model that replaces the hub download.
REQUIRES = {
    "": (),
    "distributed": (),
    "transformers": ("transformers",),
    "trl": ("trl", "transformers", "datasets", "tokenizers"),
    "trl-offline": ("trl", "transformers", "datasets", "tokenizers"),
}
# Libraries a README block may import only when its info string declares them (REQUIRES).
OPTIONAL_LIBRARIES = ("trl", "transformers", "datasets", "tokenizers", "verl", "matplotlib", "accelerate", "peft")


def _missing(kind: str) -> list:
    return [lib for lib in REQUIRES[kind] if importlib.util.find_spec(lib) is None]


def _skip_unless_installed(kind: str) -> None:
    """Skip, naming the libraries, when a library the block's info string declares is missing."""
    missing = _missing(kind)
    if missing:
        pytest.skip(f"the README's 'python {kind}' block needs {', '.join(missing)}, not installed here")


def _top_level_imports(code: str) -> set:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


_TINY_MODEL = """
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Olmo2Config, Olmo2ForCausalLM, PreTrainedTokenizerFast
vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(37)}}
core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                    padding_side="left")
model = Olmo2ForCausalLM(Olmo2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     eos_token_id=1, pad_token_id=0, bos_token_id=None))
model.save_pretrained("tiny-model")
tokenizer.save_pretrained("tiny-model")
"""


def _trl_substitute(code: str, cwd) -> str:
    """The TRL script with a tiny local model and one CPU step in place of the hub model."""
    made = _run(_TINY_MODEL, cwd)
    assert made.returncode == 0, made.stderr[-3000:]
    code, hub = re.subn(r'model_id = "[^"]+"', 'model_id = "tiny-model"', code)
    code, cfg = re.subn(r"TargetPOConfig\(", 'TargetPOConfig(max_steps=1, use_cpu=True, bf16=False, report_to="none", '
                        'save_strategy="no", ', code, count=1)
    assert hub == 1 and cfg == 1, "the TRL block names model_id and builds one TargetPOConfig"
    return code


def _distributed_substitute(code: str) -> str:
    """The block in one gloo process on a 1 x 1 CPU mesh, its tensors defined first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prelude = f"""
import os, torch, tpo_kernels
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo")
dp, cp, tp = 1, 1, 1
hidden = torch.randn(4, 5, 16, requires_grad=True)
lm_head_shard = torch.randn(32, 16, requires_grad=True)
labels = torch.randint(0, 32, (4, 5))
scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
group_ids = torch.tensor([0, 0, 1, 1])
"""
    # The block ends with the process group destroyed; the process then leaves at once: gloo's
    # threads of a DeviceMesh's sub-groups can abort the interpreter's own teardown on a loaded
    # machine ("terminate called without an active exception", after the block has run).
    return (prelude + code.replace('"cuda"', '"cpu"')
            + "\ntorch.distributed.destroy_process_group()\nimport sys; sys.stdout.flush(); os._exit(0)\n")


def test_readme_has_python_blocks():
    if not README.is_file():
        pytest.skip("README.md is not next to the tests (an installed package tested on its own)")
    assert README_BLOCKS, "README has no python example"


def test_the_trl_guide_holds_the_offline_recipe_and_the_trl_script():
    """The TRL guide beside the trainer's code opens with a recipe that runs as written offline on a
    CPU (``python trl-offline``: nothing substituted), then the training script for a hub model
    (``python trl``): both are among the blocks run here."""
    if not GUIDES[0].is_file():
        pytest.skip("the TRL guide is not next to the tests (an installed package tested on its own)")
    assert [kind for document, kind, _ in BLOCKS if document.endswith("trl/README.md")] == [" trl-offline", " trl"]


@pytest.mark.parametrize("document,kind,code", BLOCKS, ids=[_block_id(b) for b in enumerate(BLOCKS)])
def test_readme_block_runs_alone(document, kind, code, tmp_path):
    kind = kind.strip()
    assert kind in REQUIRES, f"unknown info string 'python {kind}' (tests/test_readme.py REQUIRES)"
    _skip_unless_installed(kind)
    if kind == "trl":
        code = _trl_substitute(code, tmp_path)
    elif kind == "distributed":
        code = _distributed_substitute(code)
    result = _run(code, tmp_path)
    assert result.returncode == 0, f"{document} block failed:\n{code}\n--- stderr ---\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("document,kind,code", BLOCKS, ids=[_block_id(b) for b in enumerate(BLOCKS)])
def test_readme_block_declares_the_libraries_it_imports(document, kind, code):
    """The declaration the skip decision reads is true: an optional library a block imports is
    among those its info string declares (checked whether or not the library is installed)."""
    kind = kind.strip()
    assert kind in REQUIRES, f"unknown info string 'python {kind}' (tests/test_readme.py REQUIRES)"
    undeclared = sorted((_top_level_imports(code) & set(OPTIONAL_LIBRARIES)) - set(REQUIRES[kind]))
    assert not undeclared, f"the 'python {kind}' block of {document} imports {undeclared}: declare them in its info string"


def test_trl_block_skips_when_transformers_is_missing(monkeypatch):
    """With datasets and tokenizers but without transformers (and so without a working trl), the
    TRL block is skipped, the reason naming transformers, whatever the block itself imports."""
    installed = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "transformers":
            return None
        return installed(name, *args, **kwargs) or importlib.machinery.ModuleSpec(name, None)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(pytest.skip.Exception, match=r"'python trl' block needs transformers, not installed"):
        _skip_unless_installed("trl")
    assert "datasets" not in _missing("trl") and "tokenizers" not in _missing("trl")


def test_plain_blocks_run_without_optional_libraries():
    """A plain 'python' block is never skipped: it must run with the package alone."""
    assert _missing("") == [] and _missing("distributed") == []
