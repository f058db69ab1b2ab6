"""The committed tiny base model (isojax/assets/base_model) and the script that makes it
(launch/make_base_model.py)."""

import json
import sys
from pathlib import Path

import numpy as np

import isojax
from isojax.data import Problem, synthetic_problems
from isojax.data.synthetic import VOCAB

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from launch import make_base_model as mbm  # noqa: E402  (launch/ is not a package)

ASSET = Path(isojax.__file__).parent / "assets" / "base_model"


def test_asset_files_and_size():
  names = {p.name for p in ASSET.iterdir()}
  assert {"config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json", "make_base_model.json"} <= names
  total = sum(p.stat().st_size for p in ASSET.iterdir())
  assert total < 5 * 2**20, f"asset is {total} bytes"
  cfg = json.loads((ASSET / "config.json").read_text())
  assert cfg["architectures"] == ["Qwen2ForCausalLM"]
  assert cfg["head_dim"] >= 32 and cfg["hidden_size"] == cfg["head_dim"] * cfg[
      "num_attention_heads"]
  assert cfg["vocab_size"] == len(VOCAB)
  info = json.loads((ASSET / "make_base_model.json").read_text())
  assert "--seed" in info["command"]
  fr = info["avg@16_histogram"]["fractions"]
  assert abs(sum(fr) - 1) < 1e-9
  # Both of the paper's splits exist under the base model.
  assert info["avg@16_ranges"]["[0.3,0.6]"] > 0.05
  assert info["avg@16_ranges"]["0"] + info["avg@16_ranges"]["(0,0.3)"] > 0.05


def test_tokenizer_round_trip_offline():
  from transformers import AutoTokenizer

  from isojax.models import Tokenizer

  hf = AutoTokenizer.from_pretrained(str(ASSET), local_files_only=True)
  prompt = "4821*7="
  ids = hf.encode(prompt)  # BOS is added as a special token
  vocab = {t: i for i, t in enumerate(VOCAB)}
  assert ids == [vocab["<bos>"]] + [vocab[ch] for ch in prompt]
  assert hf.decode(ids, skip_special_tokens=True) == prompt
  assert hf.decode([vocab[c] for c in "33747"] + [vocab["<eos>"]]) == "33747<eos>"
  assert hf.encode("12 + 3=", add_special_tokens=False) == [vocab[c] for c in "12+3="]
  tok = Tokenizer.from_pretrained(ASSET)
  assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (2, 0, 1)
  assert tok.apply_chat_template([{"role": "user", "content": prompt}]) == ids
  # The data pipeline's encoding (tokenizer defaults: BOS) matches the SFT format.
  from isojax.data import encode_prompts
  assert encode_prompts(tok, [Problem("x", prompt, "33747")]) == [ids]


def test_loads_in_isojax_and_transformers_with_equal_logits():
  import jax.numpy as jnp
  import torch
  from transformers import AutoModelForCausalLM

  from isojax.models import load_pretrained

  model, cfg = load_pretrained(ASSET)
  assert cfg.num_layers == 2 and cfg.head_dim >= 32
  hf = AutoModelForCausalLM.from_pretrained(str(ASSET), local_files_only=True,
                                            dtype=torch.float32)
  ids = np.array([[1, 7, 5, 16, 8, 9, 19]], np.int32)  # <bos>35+56=
  ours = np.asarray(model(jnp.asarray(ids)))
  with torch.no_grad():
    ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)


def test_base_model_solves_some_but_not_all():
  from isojax.data import exact_match
  from isojax.evaluate import evaluate
  from isojax.models import Tokenizer, load_pretrained
  from isojax.rollout.jax_sampler import JaxSampler

  model, _ = load_pretrained(ASSET)
  tok = Tokenizer.from_pretrained(ASSET)
  problems = synthetic_problems(40, seed=123)
  res = evaluate(JaxSampler(model), problems, tok, k=4, temperature=1.0, max_tokens=12,
                 reward_fn=exact_match, seed=0)
  # The base was stopped at sampled pass@1 ~0.3 over the families: far from 0 and 1.
  assert 0.05 < res.metrics["val/avg@4"] < 0.8, res.metrics


def test_script_pieces(tmp_path):
  tok = mbm.build_tokenizer()
  probs = [Problem("a", "12+34=", "46"), Problem("b", "R123=", "321")]
  ids, mask, loss = mbm.encode_sft(probs, tok, width=10)
  v = {t: i for i, t in enumerate(VOCAB)}
  want0 = [v["<bos>"]] + [v[c] for c in "12+34=46"] + [v["<eos>"]]
  assert ids[0].tolist() == want0
  assert mask[0].tolist() == [1] * 10
  # Loss only on the answer digits and EOS (positions 7, 8, 9).
  assert loss[0].tolist() == [0] * 7 + [1, 1, 1]
  assert loss[1].tolist() == [0] * 6 + [1, 1, 1, 1] and mask[1].sum() == 10
  assert mbm.token_widths({"add": (4, 4), "rev": (8, 8)}) == (11, 9)


def test_script_end_to_end_small(tmp_path):
  out = tmp_path / "tiny_base"
  mbm.main(["--out", str(out), "--seed", "1", "--hidden", "64", "--heads", "2",
            "--kv_heads", "1", "--intermediate", "64", "--max_steps", "3",
            "--eval_every", "2", "--eval_problems", "10", "--hist_problems", "10",
            "--batch", "8"])
  info = json.loads((out / "make_base_model.json").read_text())
  assert info["steps"] == 3 and info["stop_reason"] == "max_steps"
  from isojax.models import load_pretrained
  _, cfg = load_pretrained(out)
  assert cfg.hidden_size == 64 and cfg.head_dim == 32


def test_committed_splits_match_their_ranges():
  from isojax.data import load_problems
  from isojax.data.synthetic import family_of

  split_dir = ASSET.parent / "splits"
  summary = json.loads((split_dir / "summary.json").read_text())
  assert "--model" not in summary["command"] or str(ASSET) in summary["command"]
  ranges = {"easy": ("avg@16", 0.3, 0.6), "hard": ("avg@16", 0.0, 0.0625),
            "very_easy": ("avg@128", 0.6, 0.9), "easy_pass128": ("avg@128", 0.3, 0.6)}
  families = {}
  for name, count in summary["splits"].items():
    rows = [json.loads(l) for l in (split_dir / f"{name}.jsonl").read_text().splitlines()]
    assert len(rows) == count > 0
    assert len(load_problems(split_dir / f"{name}.jsonl", id_field="id")) == count
    if name in ranges:
      key, lo, hi = ranges[name]
      assert all(lo - 1e-9 <= r[key] <= hi + 1e-9 for r in rows), name
    families[name] = {family_of(Problem(r["id"], r["prompt"], r["answer"]))
                      for r in rows}
  assert all(r["pass@128"] == 0.0 for r in map(json.loads, (
      split_dir / "extremely_hard.jsonl").read_text().splitlines()))
  # Several task families in both the easy and the hard split (interference needs
  # skills that do not transfer).
  assert len(families["easy"]) >= 4 and len(families["hard"]) >= 3
  assert summary["splits"]["hard_easy"] == 2 * min(summary["splits"]["hard"],
                                                    summary["splits"]["easy"])
