"""torch, the HF tests' reference: required wherever it is not left out on purpose. Only
OAPL_NO_TORCH=1 (.ci/run's Python 3.12 venv, the newest JAX, where torch has no CPU wheel) turns
a missing torch into a skip; in the main venv (and CI's) it is a failure."""

import importlib.util

import pytest


@pytest.mark.parametrize("flag,outcome", [(None, "fail"), ("0", "fail"), ("1", "skip")])
def test_a_missing_torch_fails_unless_oapl_no_torch_is_set(monkeypatch, request, flag, outcome):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a, **k: None if name == "torch" else find_spec(name, *a, **k))
  if flag is None:
    monkeypatch.delenv("OAPL_NO_TORCH", raising=False)
  else:
    monkeypatch.setenv("OAPL_NO_TORCH", flag)
  kind = pytest.skip.Exception if outcome == "skip" else pytest.fail.Exception
  try:  # caught here, either kind: a skip where a failure is due must fail this test, not skip it
    request.getfixturevalue("requires_torch")
    raised = None
  except (pytest.skip.Exception, pytest.fail.Exception) as e:
    raised = e
  assert type(raised) is kind, raised
  assert ("on purpose: OAPL_NO_TORCH=1" if outcome == "skip" else "torch is not installed") in str(raised)


def test_an_installed_torch_is_used_even_with_oapl_no_torch(monkeypatch, request):
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: object())
  monkeypatch.setenv("OAPL_NO_TORCH", "1")
  assert request.getfixturevalue("requires_torch") is None  # neither skipped nor failed
