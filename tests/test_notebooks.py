"""Executes the notebooks top to bottom at their reduced size, so they cannot rot.

The notebooks read `OAPL_NOTEBOOK_QUICK=1` (seconds-long runs: `configs/tiny.py:smoke`, the lag
study's `reduced=True`, real_model's tiny local Qwen3 and GSM8K-format file through
`configs/gsm8k.py:tiny`, its Hub cells skipped) and `OAPL_NOTEBOOK_WORKDIR` (where the runs
go). The kernel is the `python3` one, which jupyter_client starts with this interpreter
(`sys.executable`); the install cell must find the package installed already, from this
checkout. About 1-2 minutes each on 2 CPU cores.
"""

import re
from pathlib import Path

import nbclient  # the `test` extra of setup.py
import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _execute(name: str, workdir: Path, monkeypatch) -> dict:
  """Runs notebooks/<name> in notebooks/ with the quick settings; returns {tag: code cell}."""
  path = NOTEBOOKS / name
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for c in nb.cells:
    if c.cell_type == "code":
      assert not c.outputs and c.execution_count is None, f"{name}: commit the notebook without outputs"
  monkeypatch.setenv("OAPL_NOTEBOOK_QUICK", "1")
  monkeypatch.setenv("OAPL_NOTEBOOK_WORKDIR", str(workdir))
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600, allow_errors=False,
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute()
  cells = {}
  for c in nb.cells:
    for tag in c.metadata.get("tags", []):
      cells[tag] = c
  return {"all": nb.cells, **cells}


def _stdout(cell) -> str:
  return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _pngs(cell) -> int:
  return sum(1 for o in cell.outputs if o.output_type in ("display_data", "execute_result")
             and "image/png" in o.get("data", {}))


def _check_install_cell(cells):
  text = "".join(_stdout(c) for c in cells["all"] if c.cell_type == "code")
  assert "oapl_jax is installed already" in text  # the install cell is a no-op here
  assert f"oapl_jax from {ROOT / 'oapl_jax'}" in text  # and the kernel imports this checkout
  assert "QUICK=True" in text


def test_quickstart_notebook(tmp_path, monkeypatch):
  workdir = tmp_path / "quickstart"
  cells = _execute("quickstart.ipynb", workdir, monkeypatch)
  _check_install_cell(cells)
  assert (workdir / "summary.json").is_file()
  assert re.search(r"pass@1: \d\.\d{3} -> \d\.\d{3}", _stdout(cells["train"]))
  assert _pngs(cells["curves"]) == 1

  assert _pngs(cells["passk"]) == 1
  table = _stdout(cells["passk"]).splitlines()
  assert table[0].split() == ["k", "before", "after"]
  rows = [line.split() for line in table[1:]]
  assert [r[0] for r in rows] == ["1", "2", "4"]  # smoke: 4 samples per problem
  assert all(0 <= float(v) <= 1 for r in rows for v in r[1:])

  answers = [line for line in _stdout(cells["samples"]).splitlines() if "+" in line and "=" in line]
  assert len(answers) == 6, _stdout(cells["samples"])


def test_lag_study_notebook(tmp_path, monkeypatch):
  out = tmp_path / "lag_study"
  cells = _execute("lag_study.ipynb", out, monkeypatch)
  _check_install_cell(cells)
  assert "[4/4]" in _stdout(cells["run"])
  rows = [line.split() for line in _stdout(cells["table"]).splitlines()[1:]]
  assert sorted((r[0], r[1]) for r in rows) == [("grpo_tis", "1"), ("grpo_tis", "2"), ("oapl", "1"), ("oapl", "2")]
  assert all(0 <= float(v) <= 1 for r in rows for v in r[3:7])
  assert _pngs(cells["lag_plot"]) == 1
  assert _pngs(cells["report"]) == 3
  assert (out / "lag_study.md").is_file()


def test_real_model_notebook(tmp_path, monkeypatch, requires_torch):
  """Quick mode: no Hub access (one line says why), the tiny Qwen3 through configs/gsm8k.py:tiny
  with adapters (:lora); the run, curves, pass@k, answers, and the merged HF export reloaded by
  transformers at parity, the PEFT adapter beside it."""
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  workdir = tmp_path / "real_model"
  cells = _execute("real_model.ipynb", workdir, monkeypatch)
  _check_install_cell(cells)
  intro = "".join(c.source for c in cells["all"] if c.cell_type == "markdown")
  assert "Wall times on Colab runtimes are not measured" in intro
  skipped = [line for line in _stdout(cells["fetch"]).splitlines() if "Hub fetch skipped" in line]
  assert len(skipped) == 1 and "quick mode" in skipped[0]
  assert "configs/gsm8k.py:tiny,lora" in _stdout(cells["config"])  # quick mode runs the LoRA path
  assert "LoRA rank 16" in _stdout(cells["config"]) and "frozen base" in _stdout(cells["config"])
  assert "total" in _stdout(cells["config"])  # the memory plan
  assert (workdir / "run" / "summary.json").is_file()
  assert re.search(r"pass@1: \d\.\d{3} -> \d\.\d{3}", _stdout(cells["run"]))
  assert _pngs(cells["curves"]) == 1 and _pngs(cells["passk"]) == 1
  rows = [line.split() for line in _stdout(cells["passk"]).splitlines()[1:]]
  assert [r[0] for r in rows] == ["1", "2"]  # tiny: 2 samples per problem
  samples = _stdout(cells["samples"])
  assert samples.count("\nQ: ") == 3 and samples.count("  [") == 6
  export = _stdout(cells["export"])
  assert "config.json" in export and "model.safetensors" in export and "adapter" in export
  assert (workdir / "export" / "adapter" / "adapter_model.safetensors").is_file()
  diff = float(re.search(r"max \|logits ours - transformers\| = (\S+)", export).group(1))
  assert diff < 1e-4, export
