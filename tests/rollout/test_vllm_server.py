"""Integration test against a real vLLM CPU server (its own virtualenv).

Needs $VLLM_VENV (built by `bash launch/setup_vllm_venv.sh`). Outside CI an
unset VLLM_VENV skips this file with the reason printed; in CI (CI=true) it is
a failure, because CI must exercise the real server.

The reference is isojax's own full forward pass on the same weights
(independent of vLLM's paged attention, sampler and weight loader):
logp = log_softmax(logits / temperature), renormalised over the top-p nucleus.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from isojax.models import Decoder, ModelConfig, save_pretrained
from isojax.rollout.vllm_client import VLLMSampler
from isojax.rollout.vllm_server import VLLMServer, free_port, stop_pid_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, EOS, MAX_MODEL_LEN = 96, 2, 64
PROMPTS = [[5, 17, 33, 95], [40, 41, 42, 43, 44, 45, 46], [90, 3, 70, 11, 60, 12, 50, 13, 44, 9, 1]]

# Both sides run float32 (--dtype float32 on the server). The two forward passes
# differ only in summation order (vLLM's CPU attention/GEMM kernels vs XLA's):
# ~1e-6 relative error per dot product of length <= 256, i.e. ~1e-5 absolute on
# logits of magnitude <~10 and on their logsumexp. 2e-4 leaves >10x headroom,
# while a wrong temperature, a missing top-p renormalisation, a position shift
# or rows out of prompt-major order all move logprobs by >1e-2.
LOGP_ATOL = 2e-4


def _in_ci() -> bool:
  return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def venv():
  path = os.environ.get("VLLM_VENV")
  if not path:
    reason = ("VLLM_VENV is not set, so the real vLLM server test cannot run; build "
              "the venv with `export VLLM_VENV=$(bash launch/setup_vllm_venv.sh | tail -n1)`")
    if _in_ci():
      pytest.fail(f"CI={os.environ['CI']} but {reason}")
    print(f"\nSKIPPED tests/rollout/test_vllm_server.py: {reason}")
    pytest.skip(reason)
  if not os.path.exists(os.path.join(path, "bin", "python")):
    pytest.fail(f"VLLM_VENV={path} has no bin/python; rebuild it with launch/setup_vllm_venv.sh")
  return path


def _tiny_model(seed: int = 0) -> Decoder:
  """A random 2-layer Qwen2 (head_dim 32: vLLM's CPU attention needs >= 32).

  The default 0.02-std init gives near-uniform next-token distributions and
  attention; scaling q/k and the unembedding makes both peaked, so errors in
  positions, attention or temperature show up in the logprobs.
  """
  cfg = ModelConfig.from_hf_dict({
      "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
      "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 32, "max_position_embeddings": MAX_MODEL_LEN, "rms_norm_eps": 1e-6,
      "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
      "eos_token_id": EOS})
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  for layer in model.layers:
    layer.attn.q_kernel[...] = layer.attn.q_kernel[...] * 4.0
    layer.attn.k_kernel[...] = layer.attn.k_kernel[...] * 4.0
  model.unembed[...] = model.unembed[...] * 15.0
  return model


def _counting_model(model: Decoder) -> Decoder:
  """Same shapes, new weights whose greedy continuation of token t is t+1 mod V.

  Zeroing every layer's output projections leaves the residual stream equal to
  the current token's embedding e_t; an unembedding whose column v is
  c * e_{(v-1) mod V} then scores v = t+1 highest (random 128-d embeddings are
  nearly orthogonal), so the expected output is a closed form.
  """
  for layer in model.layers:
    layer.attn.o_kernel[...] = jnp.zeros_like(layer.attn.o_kernel[...])
    layer.mlp.down_kernel[...] = jnp.zeros_like(layer.mlp.down_kernel[...])
  e_VxD = model.embed[...]
  e_VxD = e_VxD / jnp.sqrt(jnp.mean(e_VxD**2, axis=-1, keepdims=True))
  model.unembed[...] = 2.0 * jnp.roll(e_VxD, 1, axis=0).T
  return model


def _reference_logprobs(model, prompts, rollouts, n, temperature, top_p):
  """isojax logprob of every sampled token, with vLLM's processing applied."""
  seqs = rollouts.sequences()
  rows = [prompts[b // n] + s for b, s in enumerate(seqs)]
  width = max(len(r) for r in rows)
  ids = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for b, r in enumerate(rows):  # right padding: causal attention never sees it
    ids[b, :len(r)], mask[b, :len(r)] = r, True
  logits_BxTxV = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)),
                            np.float64)
  out = np.zeros_like(rollouts.logprobs_BxT, dtype=np.float64)
  for b, s in enumerate(seqs):
    p = len(prompts[b // n])
    for t, tok in enumerate(s):
      z = logits_BxTxV[b, p - 1 + t]
      z = z / temperature if temperature > 0 else z
      lp = z - np.logaddexp.reduce(z)
      if top_p < 1.0:
        order = np.argsort(-lp)
        probs = np.exp(lp[order])
        keep = np.zeros_like(lp, bool)
        keep[order] = (np.cumsum(probs) - probs) < top_p  # smallest set reaching top_p
        lp = np.where(keep, lp, -np.inf)
        lp = lp - np.logaddexp.reduce(lp[keep])
      out[b, t] = lp[tok]
  return out


def _greedy_reference(model, prompts, max_tokens):
  """Argmax decoding with isojax's full (uncached) forward, one compiled shape."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(
      ids, attention_mask=mask))
  out = []
  for prompt in prompts:
    ids = np.zeros((1, MAX_MODEL_LEN), np.int32)
    seq = list(prompt)
    for _ in range(max_tokens):
      ids[0, :len(seq)] = seq  # right padding is invisible to causal attention
      logits = forward(state, ids, np.arange(MAX_MODEL_LEN)[None] < len(seq))
      nxt = int(np.argmax(logits[0, len(seq) - 1]))
      seq.append(nxt)
      if nxt == EOS:
        break
    out.append(seq[len(prompt):])
  return out


def _run(argv, env, timeout):
  proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}" \
                               f"\n{proc.stderr[-3000:]}"
  return proc


def test_readme_commands_serve_a_tiny_run_and_stop(venv, readme, tmp_path):
  """The README's vLLM block, run as written: set-up, --detach, main, --stop.

  Only its placeholders change (port, pid file, run dir), the run is cut to a few
  updates at a large learning rate, and set-up reuses $VLLM_VENV. With the
  server in float32 the sampler/trainer logprob gap is ~1e-5; a server that
  missed a weight push samples from stale weights (with the push removed from
  the loop, the gap was 5.6 at the second update). The same command then runs
  as PipelineRL-2 against the same server.
  """
  setup, start, train, stop = readme.block_of("python launch/vllm_server.py --model")
  port, pid_file, workdir = free_port(), tmp_path / "vllm.pid", tmp_path / "tiny_vllm"
  pipelined = tmp_path / "tiny_vllm_pipelined"
  # Its own short temp dir (checked empty of weight snapshots at the end): vLLM's
  # socket paths must fit in 107 bytes, and a pytest worker's tmp_path is long.
  tmp = tempfile.mkdtemp(prefix="isojax-vllm-test-", dir="/tmp")
  env = {**os.environ, "VLLM_VENV": venv, "XLA_FLAGS": "", "TMPDIR": tmp}
  pid_place, port_place = {"/tmp/vllm.pid": str(pid_file)}, {"8000": str(port)}

  assert _run(readme.argv(setup, {}), env, 600).stdout.splitlines()[-1] == venv
  t0 = time.time()
  out = _run(readme.argv(start, {**pid_place, **port_place}) + ["--startup-timeout", "540"],
             env, 600).stdout
  assert f"vLLM server ready at http://127.0.0.1:{port}" in out, out
  pid = int(pid_file.read_text())
  print(f"\nREADME vLLM server up in {time.time() - t0:.0f} s (pid {pid})")
  try:
    os.killpg(pid, 0)  # --detach left the server (its process group) running
    steps, lr = 5, 1e-3
    short = [f"--config.budget={steps * 32}", f"--config.rl.lr_base={lr}",
             "--config.eval_every=100", "--config.data.num_val=16"]
    _run(readme.argv(train, {**port_place, "runs/tiny_vllm": str(workdir)}) + short,
         env, 600)
    # The same run as PipelineRL-2: every update's weights reach the server while
    # the next batch is in flight (pause keeping its requests, reload, resume).
    _run(readme.argv(train, {**port_place, "runs/tiny_vllm": str(pipelined)}) + short + [
        "--config.rl.pipeline.max_lag=2"], env, 600)
  finally:
    stopped = subprocess.run(readme.argv(stop, pid_place), cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    if stopped.returncode != 0:  # never leave a server behind, whatever failed
      stop_pid_file(str(pid_file))
  assert stopped.returncode == 0, stopped.stderr[-3000:]
  assert f"stopped server from {pid_file}" in stopped.stdout, stopped.stdout
  assert not pid_file.exists()
  with pytest.raises(ProcessLookupError):
    os.killpg(pid, 0)

  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(steps + 1))
  assert (workdir / "DONE").exists()
  train_records = records[1:]
  assert max(r["train/update_norm"] for r in train_records) > 0.05  # the policy moved
  for r in train_records:  # ... and the server followed it at every update
    assert r["train/logp_gap_max"] < 1e-3, r
    assert abs(r["train/tis_weight_mean"] - 1.0) < 1e-4, r
  assert not [p for p in os.listdir(tmp) if p.startswith("isojax-vllm-weights-")]
  shutil.rmtree(tmp)
  records = [json.loads(line) for line in (pipelined / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(steps + 1))
  assert all(0 <= r["train/policy_lag_max"] <= 2 for r in records[1:])
  assert records[1]["train/logp_gap_max"] < 1e-3  # batch 1: the base weights, served


@pytest.fixture(scope="module")
def served(venv, tmp_path_factory):
  """(server, sampler, model): a server on a fresh snapshot, stopped by pid at the end."""
  root = tmp_path_factory.mktemp("vllm")
  model = _tiny_model()
  base = str(root / "base")
  save_pretrained(model, model.cfg, base)
  server = VLLMServer(base, venv=venv, dtype="float32", skip_tokenizer_init=True,
                      max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                      # Eager: skips ~1 min of torch.compile at start-up; this
                      # test is about numbers and protocol, not speed.
                      extra_args=["--enforce-eager"],
                      workdir=str(root / "server"), startup_timeout_s=540)
  pid = None
  try:
    server.start()
    pid = server.process.pid
    print(f"\nvLLM server up in {server.startup_s:.1f} s (pid {pid})")
    sampler = VLLMSampler(server.base_url, weights_root=str(root / "weights"),
                          max_concurrency=8, backoff_s=0.2)
    yield server, sampler, model
    sampler.close()
  finally:
    server.stop()
    if pid is not None:  # the whole process group is gone, engine core included
      with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def _check_shapes(r, n_prompts, n, max_tokens, stops):
  assert r.num_rollouts == n_prompts * n
  assert r.tokens_BxT.shape[0] == n_prompts * n
  assert r.num_generated_tokens == int(r.lengths_B.sum())
  for b, s in enumerate(r.sequences()):
    assert 1 <= len(s) <= max_tokens
    assert all(0 <= t < VOCAB for t in s)
    if r.finish_reason_B[b] == "stop":
      assert s[-1] in stops, (b, s)  # the stop token is included
      assert not set(s[:-1]) & set(stops)
    else:
      assert len(s) == max_tokens and not set(s) & set(stops)
    assert np.all(r.tokens_BxT[b, len(s):] == 0) and np.all(r.logprobs_BxT[b, len(s):] == 0)


@pytest.mark.parametrize("temperature,top_p,n", [(0.8, 1.0, 4), (1.0, 0.7, 3)])
def test_samples_match_isojax_logprobs(served, temperature, top_p, n):
  _, sampler, model = served
  r = sampler.generate(PROMPTS, n=n, max_tokens=12, temperature=temperature,
                       top_p=top_p, stop_token_ids=[7], seed=1)
  _check_shapes(r, len(PROMPTS), n, 12, stops=(EOS, 7))
  ref = _reference_logprobs(model, PROMPTS, r, n, temperature, top_p)
  assert np.all(np.isfinite(ref[r.logprobs_BxT != 0]))  # sampled inside the nucleus
  print(f"\nT={temperature} top_p={top_p}: max |logp_vllm - logp_isojax| = "
        f"{np.abs(r.logprobs_BxT - ref).max():.2e} over {r.num_generated_tokens} tokens")
  np.testing.assert_allclose(r.logprobs_BxT, ref, atol=LOGP_ATOL, rtol=0)
  # Samples of one prompt differ (own seeds); same seed, same rollouts.
  assert len({tuple(s) for s in r.sequences()[:n]}) > 1
  again = sampler.generate(PROMPTS, n=n, max_tokens=12, temperature=temperature,
                           top_p=top_p, stop_token_ids=[7], seed=1)
  np.testing.assert_array_equal(again.tokens_BxT, r.tokens_BxT)
  # All prompts in one request: rows still come back prompt-major.
  batched = VLLMSampler(sampler.base_url, prompts_per_request=len(PROMPTS)).generate(
      PROMPTS, n=n, max_tokens=12, temperature=temperature, top_p=top_p, seed=2)
  _check_shapes(batched, len(PROMPTS), n, 12, stops=(EOS,))
  np.testing.assert_allclose(
      batched.logprobs_BxT,
      _reference_logprobs(model, PROMPTS, batched, n, temperature, top_p),
      atol=LOGP_ATOL, rtol=0)


def test_greedy_matches_argmax_decoding(served):
  _, sampler, model = served
  r = sampler.generate(PROMPTS, n=2, max_tokens=10, temperature=0.0)
  _check_shapes(r, len(PROMPTS), 2, 10, stops=(EOS,))
  for i, expected in enumerate(_greedy_reference(model, PROMPTS, 10)):
    assert r.sequences()[2 * i] == expected and r.sequences()[2 * i + 1] == expected
  ref = _reference_logprobs(model, PROMPTS, r, 2, 0.0, 1.0)
  np.testing.assert_allclose(r.logprobs_BxT, ref, atol=LOGP_ATOL, rtol=0)


def test_prompt_longer_than_context_fails_before_sending(served):
  _, sampler, _ = served
  with pytest.raises(ValueError, match=r"prompt_ids\[1\].*context of 64"):
    sampler.generate([[3, 4], list(range(3, 60))], n=1, max_tokens=8, temperature=1.0)


def test_update_weights_server_follows_new_weights(served):
  _, sampler, _ = served
  before = sampler.generate(PROMPTS, n=1, max_tokens=6, temperature=0.0).sequences()
  new = _counting_model(_tiny_model())
  sampler.update_weights(new)
  print(f"\nweight sync timings: {sampler.weights.last_timings}")
  # Same prompts as before the update: a stale prefix cache would show here.
  after = sampler.generate(PROMPTS, n=1, max_tokens=6, temperature=0.0).sequences()
  for p, a, b in zip(PROMPTS, after, before):
    expected = [(p[-1] + k) % VOCAB for k in range(1, 7)]
    if EOS in expected:
      expected = expected[:expected.index(EOS) + 1]
    assert a == expected, (p, a, expected)
    assert a != b
  assert after == _greedy_reference(new, PROMPTS, 6)
  # The client owns the stop set: without EOS the count runs through token 2.
  no_eos = VLLMSampler(sampler.base_url, eos_token_ids=()).generate(
      [PROMPTS[0]], n=1, max_tokens=6, temperature=0.0)
  assert no_eos.sequences() == [[0, 1, 2, 3, 4, 5]]
  assert no_eos.finish_reason_B.tolist() == ["length"]
  r = sampler.generate(PROMPTS, n=2, max_tokens=8, temperature=0.9, seed=3)
  np.testing.assert_allclose(r.logprobs_BxT, _reference_logprobs(new, PROMPTS, r, 2, 0.9, 1.0),
                             atol=LOGP_ATOL, rtol=0)
  # Two more pushes: only the last two snapshots stay on disk.
  sampler.update_weights(_tiny_model(seed=1))
  sampler.update_weights(new)
  snapshots = sorted(os.listdir(sampler.weights.weights_root))
  assert snapshots == ["weights_000002", "weights_000003"], snapshots
  final = sampler.generate(PROMPTS, n=1, max_tokens=6, temperature=0.0).sequences()
  assert final == after


# -- launcher faults (no vLLM needed: a fake venv whose python misbehaves) -------


def _fake_venv(tmp_path, script: str) -> str:
  bin_dir = tmp_path / "venv" / "bin"
  bin_dir.mkdir(parents=True)
  (bin_dir / "python").write_text("#!/bin/sh\n" + script + "\n")
  (bin_dir / "python").chmod(0o755)
  (tmp_path / "model").mkdir()
  (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 64}')
  return str(tmp_path / "venv")


def test_server_that_dies_reports_its_log_tail(tmp_path):
  venv = _fake_venv(tmp_path, 'echo "ValueError: head_dim 16 is not supported" >&2; exit 3')
  server = VLLMServer(str(tmp_path / "model"), venv=venv, workdir=str(tmp_path / "w"),
                      startup_timeout_s=30)
  with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 .*head_dim 16"):
    server.start()
  assert server.process is None and not os.path.exists(server.pid_file)


def test_relative_venv_and_model_paths_still_start_the_server(tmp_path, monkeypatch):
  """`VLLM_VENV=.venv-vllm`: the server process runs in its workdir, so the paths
  are made absolute first (else: no such file '.venv-vllm/bin/python')."""
  _fake_venv(tmp_path, 'echo "ValueError: the relative venv ran" >&2; exit 3')
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("VLLM_VENV", "venv")
  server = VLLMServer("model", workdir=str(tmp_path / "w"), startup_timeout_s=30)
  assert os.path.isabs(server.venv) and os.path.isabs(server.model_dir)
  with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 .*the relative venv ran"):
    server.start()


def test_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path):
  # `exec sleep`: the pid is the sleeper itself; its process group must be gone.
  venv = _fake_venv(tmp_path, "echo starting; exec sleep 600")
  server = VLLMServer(str(tmp_path / "model"), venv=venv, workdir=str(tmp_path / "w"),
                      startup_timeout_s=1.5)
  with pytest.raises(TimeoutError, match=r"(?s)did not answer .*/health within 2 s.*starting"):
    server.start()
  with open(os.path.join(str(tmp_path / "w"), "vllm_server.log")) as f:
    assert "starting" in f.read()
  assert server.process is None


def test_missing_venv_and_model_are_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="has no config.json"):
    VLLMServer(str(tmp_path), venv=str(tmp_path))
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match="no vLLM virtualenv at .*launch/setup_vllm_venv.sh"):
    VLLMServer(str(tmp_path), venv=str(tmp_path / "nope"))


def test_a_temp_dir_too_long_for_vllm_s_sockets_is_refused_before_start(tmp_path):
  # vLLM names its engine's sockets <temp dir>/<uuid4>: past 107 bytes the engine
  # died with a ZMQError in its log.
  venv = _fake_venv(tmp_path, "exit 0")
  long_dir = "/tmp/" + "d" * 66  # 71 bytes: one too many
  for extra_env in ({"TMPDIR": long_dir}, {"VLLM_RPC_BASE_PATH": long_dir}):
    server = VLLMServer(str(tmp_path / "model"), venv=venv, workdir=str(tmp_path / "w"),
                        env=extra_env)
    with pytest.raises(ValueError, match=rf"sockets in {long_dir} .*: 71 bytes.*at most 70"):
      server.start()
    assert server.process is None
  server = VLLMServer(str(tmp_path / "model"), venv=venv, workdir=str(tmp_path / "w"),
                      env={"TMPDIR": long_dir, "VLLM_RPC_BASE_PATH": "/tmp"},
                      startup_timeout_s=1.5)
  with pytest.raises(RuntimeError):  # started: the fake server exits at once
    server.start()


def test_command_binds_loopback_and_matches_the_trainer(tmp_path):
  venv = _fake_venv(tmp_path, "exit 0")
  cmd = VLLMServer(str(tmp_path / "model"), venv=venv, port=1234).command()
  assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
  flags = " ".join(cmd)
  for flag in ("--host 127.0.0.1", "--port 1234", "--logprobs-mode processed_logprobs",
               "--generation-config vllm", "--no-enable-chunked-prefill"):
    assert flag in flags
