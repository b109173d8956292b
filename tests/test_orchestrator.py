"""Our engine under JetStream's own orchestrator (Driver + LLMOrchestrator), as its server runs it."""

import asyncio
import logging
import multiprocessing

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from oapl_jax import config as config_lib
from oapl_jax.models import ModelConfig, Transformer
from oapl_jax.sampling import Engine, SamplingParams
from oapl_jax.sampling import jetstream_adapter  # installs the jax.tree_map alias
from oapl_jax.sampling.engine import engine_settings
from oapl_jax.tasks.arithmetic import CharTokenizer

_ROOT = logging.getLogger()
_LEVEL, _HANDLERS = _ROOT.level, list(_ROOT.handlers)
from jetstream.core import orchestrator  # noqa: E402  (after oapl_jax.sampling)
from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api  # noqa: E402

# Importing the orchestrator sets the root logger to DEBUG with a stdout handler; undo that.
for _h in [h for h in _ROOT.handlers if h not in _HANDLERS]:
  _ROOT.removeHandler(_h)
_ROOT.setLevel(_LEVEL)

MAX_TOKENS = 6


def _greedy_reference(model, ids, stop_ids):
  """Greedy continuation by full forward passes, stopped like JetStream stops a request."""
  ids, out = list(ids), []
  for _ in range(MAX_TOKENS):
    token = int(jnp.argmax(model(jnp.asarray([ids]))[0, -1]))
    if token in stop_ids:
      break
    out.append(token)
    ids.append(token)
  return out


async def _decode(client, request):
  tokens = []
  async for response in client.Decode(request):
    tokens.extend(response.stream_content.samples[0].token_ids)
  return tokens


def test_engine_defines_every_method_of_jetstreams_engine():
  """`Engine` is JetStream's engine by registration, not inheritance: Python would not refuse
  an engine that lacks one of the abstract methods, so this test does."""
  missing = [name for name in engine_api.Engine.__abstractmethods__
             if getattr(Engine, name, None) is getattr(engine_api.Engine, name)]
  assert not missing, missing
  assert jetstream_adapter.SampledTokens.__mro__[1] is engine_api.ResultTokens


def test_orchestrator_decodes_concurrent_requests():
  """Six requests (text and token ids) through JetStream's Driver and LLMOrchestrator on a
  three-slot engine give the greedy reference's tokens. The driver is stopped before the event
  loop closes: stopped after, its detokenize thread could still hand a result to the closed loop
  ("Event loop is closed"), and a JetStream driver thread that raises kills its whole process
  with SIGKILL (`orchestrator.JetThread`): a CI run's pytest was killed so (exit 137, no report).
  Run in a child process, so that such a kill is this test's failure, with the thread's
  traceback in the captured output, not the end of the session."""
  child = multiprocessing.get_context("spawn").Process(target=_decode_concurrent_requests)
  child.start()
  child.join(timeout=600)
  if child.is_alive():
    child.kill()
    child.join()
  assert child.exitcode == 0, (f"exit code {child.exitcode} (-9: a JetStream driver thread raised "
                               "and killed its process; its traceback is in the captured output)")


def _decode_concurrent_requests():
  tok = CharTokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, mlp_dim=128)
  model = Transformer(cfg, rngs=nnx.Rngs(5))
  graphdef, state = nnx.split(model, nnx.Param)
  settings = engine_settings(config_lib.defaults("tiny_addition").sampling) | dict(attn_chunk=8)
  engine = Engine(graphdef, cfg, SamplingParams(top_k=1), max_slots=3, max_prefill_length=16,
                  max_len=32, tokenizer=tok, **settings)  # greedy: comparable to a reference
  assert isinstance(engine, engine_api.Engine)  # built after JetStream was imported: registered
  params = engine.load_params(state, version=7)
  driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)
  client = orchestrator.LLMOrchestrator(driver=driver)
  texts = ["12+34=", "7*8=", "99-1=", "5 5", "123+4=", "0="]  # more requests than slots
  requests = [jetstream_pb2.DecodeRequest(
      text_content=jetstream_pb2.DecodeRequest.TextContent(text=t), max_tokens=MAX_TOKENS)
      for t in texts[:3]]
  requests += [jetstream_pb2.DecodeRequest(  # client-side tokenization: token ids in and out
      token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=tok.encode(t)),
      max_tokens=MAX_TOKENS) for t in texts[3:]]

  async def all_requests():
    try:
      return await asyncio.wait_for(asyncio.gather(*[_decode(client, r) for r in requests]), timeout=300)
    finally:  # stopped while the event loop is open: the detokenize thread's last results land on
      await asyncio.to_thread(driver.stop)  # it (on a closed loop the thread raised, and SIGKILLed)

  results = asyncio.run(all_requests())
  stop_ids = {tok.eos_id, tok.pad_id}
  for text, got in zip(texts, results):
    want = _greedy_reference(model, tok.encode(text, add_bos=True), stop_ids)
    assert got == want, (text, got, want)
  assert sum(len(r) for r in results) >= 12  # the requests really decoded something
  assert np.asarray(params.version) == 7  # params survive the orchestrator freeing prefixes
