"""What the README and the notebooks state agrees with the code: the numbers they give (drafts per round, block
size, published acceptance, the install instruction) and the README's demo snippet, run as written."""

import json
import re
from pathlib import Path

import torch

from dsv4_mtp_hf import DeepseekV4DSparkConfig
from dsv4_mtp_hf.generation.draft_length import AUTO_MAX_DRAFTS
from dsv4_mtp_hf.loading.remote_code import INSTALL

from .helpers import load_benchmark

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _notebook_text(name: str) -> str:
    nb = json.loads((REPO / "examples" / name).read_text())
    return " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_mtp_auto_range_is_the_code_s_everywhere():
    docs = {"README": _flat(README), "quickstart": _flat(_notebook_text("quickstart.ipynb"))}
    for name, text in docs.items():
        stated = re.findall(r"MTP (?:then )?picks K (?:≤|<=) (\d)", text)
        assert stated and {int(k) for k in stated} == {AUTO_MAX_DRAFTS}, (name, stated)


def test_dspark_block_and_published_profiles_are_the_code_s():
    text = _flat(README)
    assert f"block of up to {DeepseekV4DSparkConfig().dspark_block_size} tokens" in text
    assert f"(DSpark: up to its block of {DeepseekV4DSparkConfig().dspark_block_size})" in text
    profiles = load_benchmark("e2e_generate").PROFILES
    for name, words in (("dspark-prose", "published: {} per position on prose"), ("mtp-published", "K=3 (published {})")):
        assert words.format("/".join(f"{p:g}" for p in profiles[name])) in text, name
    assert f"{sum(profiles['dspark-code']) + 1:.1f}" == "4.4" and "~4.4 tokens per round on code" in text


def test_one_install_instruction():
    assert INSTALL in README
    for notebook in ("quickstart.ipynb", "load_from_deepseek_checkpoint.ipynb"):
        assert "pip install dsv4" not in _notebook_text(notebook)


def test_the_readme_demo_snippet_runs_as_written():
    snippet = re.search(r"```python\n(from dsv4_mtp_hf import load_demo_pair\n.*?)```", README, re.S).group(1)
    scope = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    target, drafter, ids, out = (scope[k] for k in ("target", "drafter", "ids", "out"))
    plain = target.generate(ids, max_new_tokens=64, do_sample=False)
    assert torch.equal(out, plain) and drafter.last_generation_stats.accepted > 0
