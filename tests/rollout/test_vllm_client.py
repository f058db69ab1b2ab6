"""VLLMSampler against a fake vLLM server in this process (127.0.0.1 only).

The fake speaks just enough of vLLM's HTTP API to check what the client sends
(token-id prompts, n, seeds, stop tokens, the weight-sync call sequence) and how
it handles faults: server down, HTTP errors, malformed answers, hangs.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.parse

import numpy as np
import pytest

from isojax.rollout.base import Rollouts
from isojax.rollout.interruption import (InterruptingSampler, Interruption,
                                         continuation_seed)
from isojax.rollout.vllm_client import (VLLMError, VLLMPausedError, VLLMResponseError,
                                        VLLMSampler, chunk_prompts)


class Truncated(bytes):
  """A body the fake cuts off: its Content-Length says more than it sends."""


class FakeVLLM:
  """A threaded HTTP server; `routes[(method, path)]` -> fn(body, query) -> (status, obj)."""

  def __init__(self, model_root: str | None = None, max_model_len: int = 64):
    self.calls: list[tuple[str, str, dict, object]] = []
    self.routes = {
        ("GET", "/v1/models"): lambda body, q: (200, {"object": "list", "data": [
            {"id": "tiny", "max_model_len": max_model_len, "root": model_root}]}),
        ("POST", "/v1/completions"): lambda body, q: (200, self.complete(body)),
    }
    fake = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):  # keep pytest output clean
        pass

      def _serve(self, method):
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        query = dict(urllib.parse.parse_qsl(url.query))
        fake.calls.append((method, url.path, query, body))
        route = fake.routes.get((method, url.path))
        status, obj = route(body, query) if route else (404, {"detail": "Not Found"})
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        length = len(data)
        if isinstance(obj, Truncated):  # promise more than is sent, then hang up
          length, self.close_connection = 2 * len(data) + 100, True
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(data)

      def do_GET(self):
        self._serve("GET")

      def do_POST(self):
        self._serve("POST")

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self.thread.start()

  @staticmethod
  def complete(body):
    """A well-formed answer: sample j of prompt k is [k*10 + j, 1000 + len(prompt)]."""
    n, choices = body["n"], []
    for k, p in enumerate(body["prompt"]):
      for j in range(n):
        ids = [k * 10 + j, 1000 + len(p)][: 1 + j % 2]
        choices.append({
            "index": k * n + j, "text": "", "token_ids": ids, "prompt_token_ids": p,
            "finish_reason": "length" if len(ids) == 2 else "stop",
            "logprobs": {"token_logprobs": [-0.5 - 0.1 * t for t in range(len(ids))],
                         "tokens": [f"token_id:{t}" for t in ids]}})
    # vLLM answers in index order; shuffle to check the client sorts by index.
    return {"object": "text_completion", "model": "tiny", "choices": choices[::-1]}

  def paths(self):
    return [(m, p) for m, p, _, _ in self.calls]

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def fake(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 2000}))
  server = FakeVLLM(model_root=str(tmp_path))
  yield server
  server.close()


def _sampler(url, **kw):
  kw.setdefault("backoff_s", 0.01)
  kw.setdefault("max_retries", 2)
  return VLLMSampler(url, **kw)


def test_generate_sends_token_ids_and_returns_prompt_major_rollouts(fake):
  prompts = [[5, 6, 7], [8, 9]]
  with _sampler(fake.url) as s:
    r = s.generate(prompts, n=2, max_tokens=4, temperature=0.7, top_p=0.9,
                   stop_token_ids=[11], seed=3)
  assert isinstance(r, Rollouts)
  np.testing.assert_array_equal(r.tokens_BxT, [[0, 0], [1, 1003], [0, 0], [1, 1002]])
  np.testing.assert_array_equal(r.lengths_B, [1, 2, 1, 2])
  np.testing.assert_allclose(r.logprobs_BxT, [[-0.5, 0], [-0.5, -0.6], [-0.5, 0], [-0.5, -0.6]])
  assert r.finish_reason_B.tolist() == ["stop", "length", "stop", "length"]
  assert r.num_rollouts == 4 and r.num_generated_tokens == 6
  bodies = [b for m, p, _, b in fake.calls if p == "/v1/completions"]
  assert len(bodies) == 2  # one prompt per request by default
  for i, b in enumerate(sorted(bodies, key=lambda b: b["seed"])):
    assert b["prompt"] == [prompts[i]]
    assert (b["n"], b["max_tokens"], b["temperature"], b["top_p"]) == (2, 4, 0.7, 0.9)
    assert b["logprobs"] == 0 and b["return_token_ids"] is True
    assert b["top_k"] == 0  # None -> disabled
    assert b["stop_token_ids"] == [2, 11]  # config.json's EOS is sent explicitly
    assert b["ignore_eos"] is True  # ... and the server's own EOS is not used
    assert b["seed"] == 3 * 1_000_003 + i * 2


def test_prompts_per_request_batches_distinct_prompts(fake):
  prompts = [[5], [6], [5], [7], [8]]
  assert chunk_prompts(prompts, 3) == [[0, 1], [2, 3, 4]]  # [5] twice -> split
  with _sampler(fake.url, prompts_per_request=3) as s:
    r = s.generate(prompts, n=1, max_tokens=2, temperature=1.0, seed=0)
  bodies = sorted((b for _, p, _, b in fake.calls if p == "/v1/completions"),
                  key=lambda b: b["seed"])
  assert [b["prompt"] for b in bodies] == [[[5], [6]], [[5], [7], [8]]]
  assert [b["seed"] for b in bodies] == [0, 2]
  # Row i*n+j comes from prompt i whatever the request it travelled in.
  np.testing.assert_array_equal(r.tokens_BxT[:, 0], [0, 10, 0, 10, 20])


def test_server_down_fails_fast_naming_the_url():
  with socket.socket() as sock:  # a port nobody listens on
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  t0 = time.monotonic()
  with pytest.raises(VLLMError, match=rf"{url}/v1/models is unreachable after 3 attempts"):
    _sampler(url, max_retries=2, backoff_s=0.05).generate(
        [[1, 2]], n=1, max_tokens=2, temperature=1.0)
  assert time.monotonic() - t0 < 5.0  # 0.05 + 0.1 s of backoff, no hang


def test_http_error_names_url_and_status(fake):
  fake.routes[("POST", "/v1/completions")] = lambda body, q: (
      400, {"error": {"message": "token id 5000 out of vocabulary"}})
  with pytest.raises(VLLMError, match=rf"{fake.url}/v1/completions answered HTTP 400: "
                                      r".*out of vocabulary"):
    _sampler(fake.url).generate([[1, 2]], n=1, max_tokens=2, temperature=1.0)


def test_503_is_retried_then_succeeds(fake):
  answers = iter([(503, {"error": "busy"}), (503, {"error": "busy"})])
  fake.routes[("POST", "/v1/completions")] = lambda body, q: next(
      answers, (200, FakeVLLM.complete(body)))
  r = _sampler(fake.url, max_retries=3).generate([[1, 2]], n=1, max_tokens=2,
                                                  temperature=1.0)
  assert r.sequences() == [[0]]
  assert fake.paths().count(("POST", "/v1/completions")) == 3


def test_hanging_server_times_out(fake):
  def hang(body, q):
    time.sleep(3)
    return 200, FakeVLLM.complete(body)
  fake.routes[("POST", "/v1/completions")] = hang
  t0 = time.monotonic()
  with pytest.raises(VLLMError, match=rf"{fake.url}/v1/completions did not answer within"):
    _sampler(fake.url, request_timeout_s=0.3).generate([[1]], n=1, max_tokens=2,
                                                       temperature=1.0)
  assert time.monotonic() - t0 < 2.5


def _drop(path):
  """A completion answer with the field at `path` (dotted, [i] for lists) removed."""
  def answer(body, q):
    obj = FakeVLLM.complete(body)
    obj["choices"].sort(key=lambda c: c["index"])
    *parents, last = path.split(".")
    node = obj
    for key in parents:
      node = node[int(key[1:-1])] if key.startswith("[") else node[key]
    del node[last]
    return 200, obj
  return answer


def _set(*paths_and_values):
  """A completion answer with each field at a `path` (as `_drop`) set to its value."""
  def answer(body, q):
    obj = FakeVLLM.complete(body)
    obj["choices"].sort(key=lambda c: c["index"])
    for path, value in zip(paths_and_values[::2], paths_and_values[1::2]):
      *parents, last = path.split(".")
      node = obj
      for key in parents:
        node = node[int(key[1:-1])] if key.startswith("[") else node[key]
      node[last] = value
    return 200, obj
  return answer


@pytest.mark.parametrize("route,field", [
    (_drop("choices"), "'choices' is missing"),
    (_drop("choices.[0].token_ids"), "'choices[0].token_ids' is missing"),
    (_drop("choices.[1].logprobs"), "'choices[1].logprobs' is missing"),
    (_drop("choices.[1].logprobs.token_logprobs"),
     "'choices[1].logprobs.token_logprobs' is missing"),
    (lambda b, q: (200, {"choices": [dict(c, finish_reason="abort") for c in
                                     FakeVLLM.complete(b)["choices"]]}),
     "finish_reason' is 'abort'"),
    (lambda b, q: (200, {"choices": [dict(c, logprobs={"token_logprobs": [None] * len(
        c["token_ids"])}) for c in FakeVLLM.complete(b)["choices"]]}),
     "'choices[0].logprobs.token_logprobs[0]' is None: it holds null/non-numeric values "
     "at 1 of 1 positions"),
    (lambda b, q: (200, {"choices": [dict(c, logprobs={"token_logprobs": [-1.0] * 5})
                                     for c in FakeVLLM.complete(b)["choices"]]}),
     "token_logprobs' has 5 entries but"),
    (lambda b, q: (200, {"choices": FakeVLLM.complete(b)["choices"][:1]}),
     "'choices' has 1 entries, expected 1 prompts x n=2"),
    (lambda b, q: (200, {"choices": [dict(c, prompt_token_ids=[9, 9]) for c in
                                     FakeVLLM.complete(b)["choices"]]}),
     "'choices[0].prompt_token_ids' does not match"),
    (_set("choices.[0].prompt_token_ids", 5), "'choices[0].prompt_token_ids' does not match"),
    (lambda b, q: (200, b"<html>not json</html>"), "answered non-JSON"),
    # The trainer's gather would clamp an id past the vocabulary (2000).
    (_set("choices.[0].token_ids", [2000]),
     "'choices[0].token_ids' holds token id 2000, outside the vocabulary of "
     "vocab_size=2000"),
    (_set("choices.[1].token_ids", [5, 6, 7], "choices.[1].logprobs.token_logprobs",
          [-1.0] * 3), "'choices[1].token_ids' holds 3 tokens, more than max_tokens=2"),
    (_set("choices.[1].logprobs.token_logprobs", [-1.0, 0.5]),
     "'choices[1].logprobs.token_logprobs' holds log-probability 0.5 > 0"),
    # A sampled token's log-probability is finite: the trainer's ratio against
    # -inf (or vLLM's JSON stand-in for it) is inf.
    (_set("choices.[1].logprobs.token_logprobs", [-1.0, float("-inf")]),
     "'choices[1].logprobs.token_logprobs[1]' is -inf, the log-probability of sampled "
     "token 1002 at position 1"),
    (_set("choices.[1].logprobs.token_logprobs", [float("nan"), -1.0]),
     "'choices[1].logprobs.token_logprobs[0]' is nan, the log-probability of sampled "
     "token 1 at position 0"),
    (_set("choices.[0].logprobs.token_logprobs", [-9999.0]),
     "'choices[0].logprobs.token_logprobs[0]' is -9999.0 (vLLM's stand-in for -inf), "
     "the log-probability of sampled token 0 at position 0"),
])
def test_malformed_answer_names_the_field(fake, route, field):
  fake.routes[("POST", "/v1/completions")] = route
  with pytest.raises(VLLMResponseError, match=re.escape(field)) as e:
    _sampler(fake.url).generate([[1, 2]], n=2, max_tokens=2, temperature=1.0)
  assert f"{fake.url}/v1/completions" in str(e.value)


def test_a_logprob_a_rounding_error_above_0_is_accepted(fake):
  fake.routes[("POST", "/v1/completions")] = _set(
      "choices.[1].logprobs.token_logprobs", [-1.0, 1e-6])
  r = _sampler(fake.url).generate([[1, 2]], n=2, max_tokens=2, temperature=1.0)
  assert r.logprobs_BxT[1].tolist() == pytest.approx([-1.0, 1e-6])


def test_a_truncated_answer_names_the_url_and_is_not_sent_again(fake):
  fake.routes[("POST", "/v1/completions")] = lambda b, q: (200, Truncated(b'{"choices": ['))
  with pytest.raises(VLLMError, match=rf"vLLM server at {fake.url}/v1/completions sent a "
                     r"broken answer to POST \(ChunkedEncodingError\)"):
    _sampler(fake.url).generate([[1, 2]], n=2, max_tokens=2, temperature=1.0)
  assert fake.paths().count(("POST", "/v1/completions")) == 1


def test_malformed_models_answer_names_the_field(fake):
  fake.routes[("GET", "/v1/models")] = lambda b, q: (200, {"data": [{"id": "x"}]})
  with pytest.raises(VLLMResponseError, match=r"'data\[0\].max_model_len' is missing"):
    _sampler(fake.url).generate([[1]], n=1, max_tokens=2, temperature=1.0)


def test_prompt_too_long_fails_before_sending(fake):
  with pytest.raises(ValueError, match=r"prompt_ids\[1\] has 60 tokens; with "
                                       r"max_tokens=8 .* context of 64"):
    _sampler(fake.url).generate([[1, 2], list(range(60))], n=1, max_tokens=8,
                                temperature=1.0)
  assert ("POST", "/v1/completions") not in fake.paths()


def _think_or_answer(body, q):
  """Prompts starting with 1 end at once with EOS (2); others run to max_tokens:
  sample j of a prompt of length L is L*10 + j, L*10 + j + 1, ..."""
  choices = []
  for k, p in enumerate(body["prompt"]):
    for j in range(body["n"]):
      ids = [2] if p[0] == 1 else [len(p) * 10 + j + t for t in range(body["max_tokens"])]
      choices.append({"index": k * body["n"] + j, "token_ids": ids,
                      "finish_reason": "stop" if p[0] == 1 else "length",
                      "logprobs": {"token_logprobs": [-0.5] * len(ids)}})
  return 200, {"choices": choices}


def test_interrupting_sampler_over_the_client(fake):
  fake.routes[("POST", "/v1/completions")] = _think_or_answer
  spec = Interruption(think_tokens=3, answer_tokens=2, phrase_ids=(90, 91))
  sampler = InterruptingSampler(_sampler(fake.url), spec)
  with pytest.raises(ValueError, match="that is 65 > the sampler's context of 64"):
    sampler.generate([list(range(3, 61))], n=1, max_tokens=7, temperature=1.0)
  assert ("POST", "/v1/completions") not in fake.paths()
  r = sampler.generate([[1, 5], [3, 4, 5]], n=2, max_tokens=7, temperature=1.0, seed=3)
  assert r.sequences() == [[2], [2], [30, 31, 32, 90, 91, 80, 81],
                           [31, 32, 33, 90, 91, 80, 81]]
  assert r.forced_BxT[2:].tolist() == [[0, 0, 0, 1, 1, 0, 0]] * 2
  np.testing.assert_array_equal(r.logprobs_BxT[2], [-0.5] * 3 + [0, 0] + [-0.5] * 2)
  assert r.finish_reason_B.tolist() == ["stop", "stop", "length", "length"]
  assert r.num_generated_tokens == 1 + 1 + 5 + 5
  # Requests run concurrently: order the continuations' by seed.
  answers = sorted([b for _, p, _, b in fake.calls if p == "/v1/completions"][2:],
                   key=lambda b: b["seed"])
  assert [b["prompt"] for b in answers] == [[[3, 4, 5, 30, 31, 32, 90, 91]],
                                            [[3, 4, 5, 31, 32, 33, 90, 91]]]
  assert all(b["max_tokens"] == 2 and b["n"] == 1 for b in answers)
  # The client seeds the request of prompt i with seed * 1_000_003 + i * n.
  assert [b["seed"] for b in answers] == [continuation_seed(3) * 1_000_003 + i
                                          for i in range(2)]


def test_bad_arguments_fail_before_sending(fake):
  s = _sampler(fake.url)
  with pytest.raises(ValueError, match="prompt_ids\\[0\\] has token ids outside"):
    s.generate([[1, 5000]], n=1, max_tokens=2, temperature=1.0)  # vocab 2000
  with pytest.raises(ValueError, match="top_p"):
    s.generate([[1]], n=1, max_tokens=2, temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match="base_url"):
    VLLMSampler("127.0.0.1:8000")
  assert ("POST", "/v1/completions") not in fake.paths()


# -- weight sync ---------------------------------------------------------------


def _weight_routes(fake, *, reload_status=200, reset_answers=None):
  """Weight-sync routes. Like vLLM, a reset is refused while a "keep" pause holds
  requests, unless it preempts them (reset_running_requests=true)."""
  reset_answers = iter(reset_answers or [])
  fake.pause_modes = []  # the mode of every /pause

  def pause(b, q):
    fake.pause_modes.append(q.get("mode"))
    return 200, {"status": "paused"}

  def reset(b, q):
    held = fake.pause_modes[-1] == "keep" and q.get("reset_running_requests") != "true"
    return 200, {"success": not held and next(reset_answers, True)}

  fake.routes.update({
      ("POST", "/pause"): pause,
      ("POST", "/collective_rpc"): lambda b, q: (
          (200, {"results": [None]}) if reload_status == 200
          else (reload_status, {"error": "reload_weights failed: shape mismatch"})),
      ("POST", "/reset_prefix_cache"): reset,
      ("POST", "/resume"): lambda b, q: (200, {"status": "resumed"}),
  })


@pytest.fixture(scope="module")
def tiny_model():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from isojax.models import Decoder, ModelConfig  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig.from_hf_dict({
      "architectures": ["Qwen2ForCausalLM"], "vocab_size": 2000, "hidden_size": 16,
      "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 32,
      "eos_token_id": 3})
  return Decoder(cfg, rngs=nnx.Rngs(0))


def test_update_weights_protocol_and_keeps_last_two(fake, tiny_model, tmp_path):
  _weight_routes(fake, reset_answers=[False, True])  # first reset refused: retried
  root = tmp_path / "weights"
  s = _sampler(fake.url, weights_root=str(root))
  s.update_weights(tiny_model)
  first = [(m, p, q, b) for m, p, q, b in fake.calls]
  assert first.pop(0)[:2] == ("GET", "/v1/models")  # the served layout, checked first
  assert [(m, p) for m, p, _, _ in first] == [
      ("POST", "/pause"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"),
      ("POST", "/reset_prefix_cache"), ("POST", "/resume")]
  assert first[0][2] == {"mode": "wait"} and first[2][2] == first[3][2] == {}
  snapshot = root / "weights_000001"
  assert first[1][3] == {"method": "reload_weights",
                         "kwargs": {"weights_path": str(snapshot)}}
  assert (snapshot / "config.json").exists() and (snapshot / "model.safetensors").exists()
  assert json.loads((snapshot / "config.json").read_text())["architectures"] == [
      "Qwen2ForCausalLM"]
  s.update_weights(tiny_model)
  s.update_weights(tiny_model)
  assert sorted(p.name for p in root.iterdir()) == ["weights_000002", "weights_000003"]
  assert s.weights.num_pushes == 3
  assert set(s.weights.last_timings) >= {"pause_s", "reload_s", "resume_s", "save_s"}


def test_in_flight_update_keeps_requests_and_preempts_them_at_the_reset(fake, tiny_model,
                                                                       tmp_path):
  _weight_routes(fake)
  s = _sampler(fake.url, weights_root=str(tmp_path / "w"), in_flight=True)
  s.update_weights(tiny_model)
  assert fake.pause_modes == ["keep"]
  assert [(p, q) for _, p, q, _ in fake.calls] == [
      ("/v1/models", {}), ("/pause", {"mode": "keep"}), ("/collective_rpc", {}),
      ("/reset_prefix_cache", {"reset_running_requests": "true"}), ("/resume", {})]
  # Without the preemption the kept requests' blocks stay held: the reset fails
  # (after its retries) and the server is still resumed.
  s.weights.in_flight = False
  fake.pause_modes.append("keep")
  fake.calls.clear()
  with pytest.raises(VLLMError, match="reset_prefix_cache kept answering success=false"):
    s.weights._reset_prefix_cache(attempts=2)


def test_tokens_carry_the_version_current_when_generate_started(fake, tiny_model,
                                                                tmp_path):
  _weight_routes(fake)
  s = _sampler(fake.url, weights_root=str(tmp_path / "w"), in_flight=True)
  prompts = [[5, 6, 7], [8, 9]]
  r = s.generate(prompts, n=2, max_tokens=4, temperature=1.0)
  np.testing.assert_array_equal(r.version_BxT, [[0, -1], [0, 0], [0, -1], [0, 0]])
  # An update from another thread while the requests are being answered: those
  # tokens keep the label of the start (a lower bound), later calls get the new one.
  updates = []

  def complete_during_update(body, q):
    if not updates:
      updates.append(threading.Thread(target=s.update_weights, args=(tiny_model,),
                                       kwargs=dict(version=9)))
      updates[0].start()
      updates[0].join(timeout=60)
    return 200, fake.complete(body)

  fake.routes[("POST", "/v1/completions")] = complete_during_update
  r = s.generate(prompts, n=2, max_tokens=4, temperature=1.0)
  assert not updates[0].is_alive() and fake.pause_modes == ["keep"]
  assert set(r.version_BxT[r.version_BxT >= 0].tolist()) == {0}
  assert (s.generate(prompts, n=1, max_tokens=4, temperature=1.0).version_BxT[:, 0]
          == 9).all()
  s.update_weights(tiny_model)
  assert (s.generate(prompts, n=1, max_tokens=4, temperature=1.0).version_BxT[:, 0]
          == 10).all()
  with pytest.raises(ValueError, match=r"VLLMSampler.update_weights: version=-2"):
    s.update_weights(tiny_model, version=-2)


def test_close_removes_its_own_temp_snapshots_but_not_a_given_root(fake, tiny_model,
                                                                   tmp_path):
  _weight_routes(fake)
  own = _sampler(fake.url)
  own.update_weights(tiny_model)
  temp_root = own.weights.weights_root
  assert os.listdir(temp_root) == ["weights_000001"]
  own.close()
  assert not os.path.exists(temp_root)  # a 7B snapshot must not linger in /tmp

  given = tmp_path / "weights"
  s = _sampler(fake.url, weights_root=str(given))
  s.update_weights(tiny_model)
  s.close()
  assert [p.name for p in given.iterdir()] == ["weights_000001"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_the_first_push_removes_the_snapshots_of_gone_writers_only(fake, tiny_model,
                                                                   tmp_path):
  import subprocess
  import sys
  from isojax.rollout import snapshots
  _weight_routes(fake)
  root = tmp_path / "w"
  earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  start = snapshots._start_time(earlier.pid)  # pylint: disable=protected-access
  earlier.kill()
  earlier.wait()
  for name in ("weights_000001", "weights_000002"):  # an earlier run's, now gone
    (root / name).mkdir(parents=True)
    (root / name / "config.json").write_text("{}")
    (root / name / snapshots.RECORD).write_text(json.dumps(
        dict(snapshots.writer_record(), pid=earlier.pid, start=start)))
  (root / "weights_000003").mkdir()  # no writer record: not provably isojax's
  (root / "weights_000003" / "config.json").write_text("{}")
  _sampler(fake.url, weights_root=str(root)).update_weights(tiny_model)
  assert sorted(p.name for p in root.iterdir()) == ["weights_000003", "weights_000004"]
  record = json.loads((root / "weights_000004" / snapshots.RECORD).read_text())
  assert record["pid"] == os.getpid()
  # Another sampler of a live process (this one) leaves that snapshot alone.
  _sampler(fake.url, weights_root=str(root)).update_weights(tiny_model)
  assert sorted(p.name for p in root.iterdir()) == [
      "weights_000003", "weights_000004", "weights_000005"]


def test_failed_reload_names_url_and_still_resumes(fake, tiny_model, tmp_path):
  _weight_routes(fake, reload_status=500)
  s = _sampler(fake.url, weights_root=str(tmp_path / "w"))
  with pytest.raises(VLLMError, match=rf"{fake.url}/collective_rpc answered HTTP 500: "
                                      r".*shape mismatch"):
    s.update_weights(tiny_model)
  assert fake.paths()[-1] == ("POST", "/resume")


def test_a_truncated_reload_answer_names_url_and_still_resumes(fake, tiny_model, tmp_path):
  _weight_routes(fake)
  fake.routes[("POST", "/collective_rpc")] = lambda b, q: (200, Truncated(b'{"res'))
  s = _sampler(fake.url, weights_root=str(tmp_path / "w"))
  with pytest.raises(VLLMError, match=rf"{fake.url}/collective_rpc sent a broken answer"):
    s.update_weights(tiny_model)
  assert fake.paths()[-1] == ("POST", "/resume")


def test_a_pause_the_client_gave_up_on_is_still_resumed(fake, tiny_model, tmp_path):
  _weight_routes(fake)
  fake.routes[("POST", "/pause")] = lambda b, q: (time.sleep(1.0), (200, {}))[1]
  s = _sampler(fake.url, weights_root=str(tmp_path / "w"), request_timeout_s=0.2)
  with pytest.raises(VLLMError, match=rf"{fake.url}/pause did not answer within 0.2 s"):
    s.update_weights(tiny_model)
  assert fake.paths()[-1] == ("POST", "/resume")


def _pausing_routes(fake, resume_statuses):
  """Weight routes where, as in vLLM, a pause holds every completion request until
  a /resume answers 200; /resume answers `resume_statuses` (a list, consumed) first."""
  _weight_routes(fake)
  resumed = threading.Event()
  resumed.set()

  def pause(b, q):
    fake.pause_modes.append(q.get("mode"))
    resumed.clear()
    return 200, {"status": "paused"}

  def resume(b, q):
    if resume_statuses:
      return resume_statuses.pop(0), {"error": "resume failed"}
    resumed.set()
    return 200, {"status": "resumed"}

  def complete(b, q):
    resumed.wait(timeout=5)
    return 200, fake.complete(b)
  fake.routes.update({("POST", "/pause"): pause, ("POST", "/resume"): resume,
                      ("POST", "/v1/completions"): complete})


def test_a_failed_resume_after_a_reload_is_retried_then_named(fake, tiny_model, tmp_path):
  statuses = [500, 503]  # the fake's 503 is also retried by the client itself
  _pausing_routes(fake, statuses)
  s = _sampler(fake.url, weights_root=str(tmp_path / "w"), request_timeout_s=2)
  s.update_weights(tiny_model)  # /resume failed twice, then answered
  assert fake.paths().count(("POST", "/resume")) == 3 and s.weights.paused_after is None
  assert s.weights.num_pushes == 1

  statuses[:] = [500] * 3
  with pytest.raises(VLLMPausedError, match=rf"vLLM server at {fake.url} may be left "
                     r"paused after reloading its weights from .*weights_000002, which "
                     rf"succeeded: POST {fake.url}/resume failed 3 times \(last: .*HTTP 500"):
    s.update_weights(tiny_model)
  # Neither a generate nor a push goes on against the paused server (a generate
  # would wait out request_timeout_s and fail as "hung"): each tries /resume only.
  statuses[:] = [500] * 6
  fake.calls.clear()
  with pytest.raises(VLLMPausedError, match=rf"{fake.url} may be left paused after "
                                            r"reloading .*weights_000002"):
    s.generate([[1, 2]], n=1, max_tokens=2, temperature=1.0)
  with pytest.raises(VLLMPausedError, match=rf"{fake.url}/resume failed 3 times"):
    s.update_weights(tiny_model)
  assert fake.paths() == [("POST", "/resume")] * 6
  assert sorted(os.listdir(tmp_path / "w")) == ["weights_000001", "weights_000002"]
  # Once /resume answers, the next call resumes the server and carries on.
  r = s.generate([[1, 2]], n=1, max_tokens=2, temperature=1.0)
  assert r.sequences() == [[0]] and s.weights.paused_after is None
  assert fake.paths()[6:] == [("POST", "/resume"), ("POST", "/v1/completions")]


def test_a_generate_waiting_through_an_update_that_leaves_the_server_paused_says_so(
    fake, tiny_model, tmp_path):
  _pausing_routes(fake, [500] * 3)
  arrived, release = threading.Event(), threading.Event()
  complete = fake.routes[("POST", "/v1/completions")]

  def held(b, q):  # in flight when the update pauses the server
    arrived.set()
    release.wait(timeout=5)
    return complete(b, q)
  fake.routes[("POST", "/v1/completions")] = held
  s = _sampler(fake.url, weights_root=str(tmp_path / "w"), in_flight=True,
               wait_log_s=0.05, request_timeout_s=3)
  s.model_info()
  raised = []

  def generate():
    try:
      s.generate([[1, 2]], n=1, max_tokens=2, temperature=1.0)
    except Exception as e:  # pylint: disable=broad-except
      raised.append(e)
  waiting = threading.Thread(target=generate)
  waiting.start()
  assert arrived.wait(timeout=10)
  with pytest.raises(VLLMPausedError):
    s.update_weights(tiny_model)
  release.set()
  waiting.join(timeout=30)
  assert len(raised) == 1 and isinstance(raised[0], VLLMPausedError), raised
  assert re.search(rf"1/1 requests to {fake.url} wait on a server left paused after "
                   r"reloading its weights from .*weights_000001", str(raised[0]))


@pytest.mark.parametrize("served, differ", [
    ({"intermediate_size": 48}, r"intermediate_size 32 \(served: 48\)"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings False \(served: True\)"),
    ({"num_key_value_heads": 2, "head_dim": 4},
     r"num_key_value_heads 1 \(served: 2\); head_dim 8 \(served: 4\)"),
    # Same tensors, another function: vLLM would keep its own and sample another model.
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     r"rope_theta 10000.0 \(served: 1000000.0\)"),
    ({"rms_norm_eps": 1e-5}, r"rms_norm_eps 1e-06 \(served: 1e-05\)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0}},
     r"rope_type 'default' \(served: 'llama3'\)"),
])
def test_a_model_the_server_does_not_serve_is_refused_before_any_request(
    fake, tiny_model, tmp_path, served, differ):
  _weight_routes(fake)
  (tmp_path / "config.json").write_text(json.dumps({**tiny_model.cfg.to_hf_dict(), **served}))
  s = _sampler(fake.url, weights_root=str(tmp_path / "w"))
  with pytest.raises(ValueError, match=rf"at {fake.url} is not the one it serves: {differ}"):
    s.update_weights(tiny_model)
  assert fake.paths() == [("GET", "/v1/models")] and not (tmp_path / "w").exists()
  (tmp_path / "config.json").write_text(json.dumps(tiny_model.cfg.to_hf_dict()))
  _sampler(fake.url, weights_root=str(tmp_path / "w")).update_weights(tiny_model)


def test_eos_comes_from_the_pushed_model_when_the_served_config_is_not_visible(
    tiny_model, tmp_path, caplog):
  server = FakeVLLM(model_root="Qwen/Qwen2.5-0.5B-Instruct")  # served from a hub id
  try:
    _weight_routes(server)
    s = _sampler(server.url, weights_root=str(tmp_path / "w"))
    with caplog.at_level(logging.WARNING):
      s.generate([[4, 5]], n=1, max_tokens=2, temperature=1.0)
    assert "config.json is not readable here" in caplog.text
    assert server.calls[-1][3]["stop_token_ids"] == []
    s.update_weights(tiny_model)
    s.generate([[4, 5]], n=1, max_tokens=2, temperature=1.0)
    assert server.calls[-1][3]["stop_token_ids"] == [3]  # the pushed config.json's
  finally:
    server.close()


def test_update_weights_server_down(tiny_model, tmp_path):
  s = VLLMSampler("http://127.0.0.1:9", weights_root=str(tmp_path / "w"),
                  max_retries=1, backoff_s=0.01)
  with pytest.raises(VLLMError, match=r"http://127.0.0.1:9/v1/models is unreachable"):
    s.update_weights(tiny_model)


def test_greedy_asks_for_one_sample_and_repeats_it(fake):
  # vLLM answers HTTP 400 to n > 1 with temperature 0.
  r = _sampler(fake.url).generate([[4, 5], [6]], n=3, max_tokens=2, temperature=0.0)
  bodies = [b for _, p, _, b in fake.calls if p == "/v1/completions"]
  assert [b["n"] for b in bodies] == [1, 1] and all(b["temperature"] == 0 for b in bodies)
  assert r.sequences() == [[0]] * 6 and r.num_rollouts == 6


@pytest.fixture
def silent_server():
  """Accepts TCP connections (the kernel's backlog) and never answers a byte."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_silent_server_fails_at_first_contact_with_a_log_line(silent_server, caplog):
  caplog.set_level("INFO")
  s = _sampler(silent_server, connect_timeout_s=0.5, probe_timeout_s=0.3)
  t0 = time.monotonic()
  with pytest.raises(VLLMError, match=rf"{silent_server}/v1/models did not answer "
                                      r"within 0.3 s"):
    s.wait_until_ready()
  assert time.monotonic() - t0 < 5.0
  assert any(f"contacting the vLLM server at {silent_server}" in r.getMessage()
             and "connect timeout" in r.getMessage() for r in caplog.records)


def test_close_while_generate_waits_names_the_cancelled_requests(fake):
  fake.routes[("POST", "/v1/completions")] = lambda b, q: (time.sleep(0.5),
                                                           (200, fake.complete(b)))[1]
  s = _sampler(fake.url, max_concurrency=1, wait_log_s=0.05)
  raised = []

  def generate():
    try:
      s.generate([[1], [2], [3]], n=1, max_tokens=2, temperature=1.0)
    except Exception as e:  # pylint: disable=broad-except
      raised.append(e)

  waiting = threading.Thread(target=generate)
  waiting.start()
  time.sleep(0.2)  # the first request is being answered, two queued
  s.close()
  waiting.join(timeout=30)
  assert len(raised) == 1 and isinstance(raised[0], VLLMError), raised
  assert re.search(rf"close\(\) was called while generate waited: 2 of its 3 requests to "
                   rf"{fake.url} were cancelled", str(raised[0]))


def test_bad_arguments_fail_before_contacting_a_down_server():
  s = _sampler("http://127.0.0.1:9", max_retries=5, backoff_s=10.0)  # ~5 min if contacted
  with pytest.raises(ValueError, match="n must be a positive int"):
    s.generate([[1, 2]], n=0, max_tokens=4, temperature=1.0)
  with pytest.raises(ValueError, match=r"seed=1180591620717411303424 must be an int"):
    s.generate([[1, 2]], n=1, max_tokens=4, temperature=1.0, seed=2**70)


def test_slow_generate_logs_while_waiting(fake, caplog):
  def slow(body, q):
    time.sleep(0.6)
    return 200, FakeVLLM.complete(body)
  fake.routes[("POST", "/v1/completions")] = slow
  caplog.set_level("INFO")
  r = _sampler(fake.url, wait_log_s=0.1, request_timeout_s=10).generate(
      [[1]], n=1, max_tokens=2, temperature=1.0)
  assert r.sequences() == [[0]]
  waits = [m for m in caplog.messages if m.startswith("waiting for 1/1 requests")]
  assert waits and "each fails after 10 s without an answer" in waits[0]


def test_timeouts_must_be_bounded():
  with pytest.raises(ValueError, match="request_timeout_s=inf"):
    VLLMSampler("http://127.0.0.1:9", request_timeout_s=float("inf"))


@pytest.mark.parametrize("kw, msg", [
    (dict(max_retries=-1), r"max_retries=-1 must be an int >= 0"),
    (dict(max_retries=1.5), r"max_retries=1.5 must be an int"),
    # Else refused only at the first retry, by time.sleep.
    (dict(backoff_s=-1), r"backoff_s=-1 must be a finite number of seconds >= 0"),
    (dict(backoff_s=float("nan")), r"backoff_s=nan must be"),
])
def test_retry_settings_are_checked_at_construction(kw, msg):
  with pytest.raises(ValueError, match=msg):
    VLLMSampler("http://127.0.0.1:9", **kw)


def _vllm_config(url):
  from experiments import common
  c = common.base_config()
  c.sampler.backend = "vllm"
  c.sampler.vllm_url = url
  c.sampler.vllm_connect_timeout_s = 0.5
  c.sampler.vllm_probe_timeout_s = 0.5
  return c


@pytest.mark.parametrize("server", ["down", "silent", "no_weight_sync"])
def test_failed_start_leaves_no_weight_snapshot(server, fake, silent_server, tiny_model,
                                                tmp_path, monkeypatch):
  import tempfile
  from isojax import run_setup
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  url = {"down": "http://127.0.0.1:9", "silent": silent_server,
         "no_weight_sync": fake.url}[server]  # the fake has no /pause: HTTP 404
  monkeypatch.setattr(VLLMSampler.__init__, "__kwdefaults__",
                      {**VLLMSampler.__init__.__kwdefaults__, "backoff_s": 0.01,
                       "max_retries": 1})
  with pytest.raises(VLLMError, match=re.escape(url)):
    run_setup._sampler(_vllm_config(url), tiny_model, mesh=None)
  if server == "no_weight_sync":  # a snapshot was written before the push failed
    assert ("GET", "/v1/models") in fake.paths()
  assert os.listdir(tmp_path / "tmp") == []


def test_a_request_in_flight_after_close_does_not_hold_the_exit(fake):
  """A process that closed its sampler (Ctrl-C, an error) exits at once, even with
  a request still waiting on a server that does not answer."""
  import subprocess
  import sys
  answer = threading.Event()
  fake.routes[("POST", "/v1/completions")] = lambda b, q: (answer.wait(30),
                                                           (200, fake.complete(b)))[1]
  script = (
      "import threading, time\n"
      "from isojax.rollout.vllm_client import VLLMSampler\n"
      f"s = VLLMSampler({fake.url!r}, request_timeout_s=60, eos_token_ids=())\n"
      "threading.Thread(target=s.generate, args=([[1, 2]],), daemon=True,\n"
      "                 kwargs=dict(n=1, max_tokens=2, temperature=1.0)).start()\n"
      "time.sleep(1.0)\n"
      "s.close()\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
  t0 = time.monotonic()
  try:
    subprocess.run([sys.executable, "-c", script], env=env, cwd=root, timeout=25,
                   check=True, capture_output=True)
  finally:
    answer.set()
  assert time.monotonic() - t0 < 25
  assert any(p == "/v1/completions" for _, p in fake.paths())


def test_close_closes_the_connections_it_kept_alive(fake):
  """vLLM keeps connections alive (HTTP/1.1): close() hangs them up, not the
  garbage collector (the sampler and its WeightSync hold each other)."""
  handler = fake.httpd.RequestHandlerClass
  handler.protocol_version = "HTTP/1.1"
  open_connections = []
  serve = handler.handle

  def handle(self):
    open_connections.append(self)
    try:
      serve(self)
    finally:
      open_connections.remove(self)
  handler.handle = handle
  s = _sampler(fake.url)
  s.wait_until_ready()  # on this thread
  s.generate([[1, 2], [3]], n=1, max_tokens=2, temperature=1.0)  # on the pool's
  assert open_connections
  s.close()
  deadline = time.monotonic() + 5
  while open_connections and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not open_connections
