"""A run's problem sets (isojax/data/problem_sets.py): validation-set mappings,
num_train subsamples and difficulty mixtures, on small problem files."""

import ml_collections
import pytest

from isojax.data import Problem, write_jsonl
from isojax.data.problem_sets import (check_data_config, load_problem_sets, metric_prefix,
                                      parse_val_spec)


def _data(**kw):
  d = dict(train="synthetic", val="", num_val=4, num_train=0, split_seed=0)
  d.update(kw)
  return ml_collections.ConfigDict(d)


def _problems(tag, count):
  return [Problem(id=f"{tag}{i}", prompt=f"{tag}{i}=", answer=str(i)) for i in range(count)]


@pytest.fixture
def split_dir(tmp_path):
  """Split files like isojax/assets/splits: 40 hard, 30 easy, 20 very_easy."""
  for tag, count in (("hard", 40), ("easy", 30), ("very_easy", 20)):
    write_jsonl(_problems(tag, count), tmp_path / f"{tag}.jsonl")
  return tmp_path


def test_val_spec_forms_and_primary_order():
  assert parse_val_spec("") == [("val", "heldout")]
  assert parse_val_spec("/data/v.jsonl") == [("val", "/data/v.jsonl")]
  # The first named set is primary whatever its name sorts as.
  assert parse_val_spec("zed=heldout, ood=/d/aime.jsonl") == [
      ("zed", "heldout"), ("ood", "/d/aime.jsonl")]
  assert [metric_prefix(i, n) for i, n in enumerate(["zed", "ood"])] == ["val/", "val/ood/"]


@pytest.mark.parametrize("spec, match", [
    ("a=heldout,b", r"item 'b' is not NAME=SOURCE"),
    ("a=heldout,a=x.jsonl", r"set name 'a' appears twice"),
    ("a/b=heldout", r"set name 'a/b' must be"),
    ("=heldout", r"set name '' must be"),
    ("a=", r"set 'a' has an empty source"),
])
def test_malformed_mapping_names_the_key(spec, match):
  with pytest.raises(ValueError, match=r"config\.data\.val=.*" + match):
    parse_val_spec(spec)


def test_missing_sets_fail_before_loading_naming_the_key(split_dir, tmp_path):
  with pytest.raises(ValueError, match=r"config\.data\.val\['ood'\].*nope\.jsonl.*not exist"):
    check_data_config(_data(val=f"in=heldout,ood={tmp_path}/nope.jsonl"), split_dir)
  with pytest.raises(ValueError, match=r"config\.data\.val\['x'\]='synthetic:medium'.*"
                                       r"no split file .*medium\.jsonl"):
    check_data_config(_data(val="in=heldout,x=synthetic:medium"), split_dir)
  with pytest.raises(ValueError, match=r"config\.data\.train='mix:.*no split file"):
    check_data_config(_data(train="mix:hard:0.5,medium:0.5", num_train=8,
                            val="h=synthetic:hard"), split_dir)
  with pytest.raises(ValueError, match=r"needs config\.data\.num_train > 0"):
    check_data_config(_data(train="mix:hard:0.5,easy:0.5", val="h=synthetic:hard"),
                      split_dir)
  with pytest.raises(ValueError, match=r"set 'val' is held out.*mixture"):
    check_data_config(_data(train="mix:hard:0.5,easy:0.5", num_train=8), split_dir)
  with pytest.raises(ValueError, match=r"sum to 1"):
    check_data_config(_data(train="mix:hard:0.5,easy:0.4", num_train=8,
                            val="h=synthetic:hard"), split_dir)


def test_an_empty_training_file_is_named_as_empty(split_dir, tmp_path):
  (tmp_path / "empty.jsonl").write_text("\n")
  write_jsonl(_problems("v", 3), tmp_path / "v.jsonl")
  for val in (f"v={tmp_path}/v.jsonl", "in=heldout"):
    with pytest.raises(ValueError, match=rf"^config\.data\.train='{tmp_path}/empty\.jsonl' "
                                         r"holds no problems$"):
      load_problem_sets(_data(train=f"{tmp_path}/empty.jsonl", val=val), split_dir)


def test_heldout_primary_is_the_single_set_of_before(split_dir, tmp_path):
  ood = _problems("ood", 5)
  write_jsonl(ood, tmp_path / "ood.jsonl")
  d = _data(train="synthetic:easy")
  train1, sets1 = load_problem_sets(d, split_dir)
  d.val = f"in_domain=heldout,ood={tmp_path}/ood.jsonl"
  train2, sets2 = load_problem_sets(d, split_dir)
  assert list(sets1) == ["val"] and list(sets2) == ["in_domain", "ood"]
  assert sets2["in_domain"] == sets1["val"] and len(sets1["val"]) == 4
  assert train2 == train1 and len(train1) == 26
  assert [p.prompt for p in sets2["ood"]] == [p.prompt for p in ood]


def test_no_validation_problem_is_trained_on(split_dir):
  # Train on easy, validate on easy and hard pools: the easy val problems leave
  # the training set; nothing is held out when no set asks for it.
  d = _data(train="synthetic:easy", val="e=synthetic:easy,h=synthetic:hard", num_val=6)
  train, sets = load_problem_sets(d, split_dir)
  assert [len(v) for v in sets.values()] == [6, 6]
  val_prompts = {p.prompt for v in sets.values() for p in v}
  assert not val_prompts & {p.prompt for p in train}
  assert len(train) == 30 - 6
  # The val draw depends on split_seed only.
  d.split_seed = 1
  assert load_problem_sets(d, split_dir)[1]["e"] != sets["e"]


def test_num_train_subsamples_any_source(split_dir):
  d = _data(train="synthetic:hard", num_train=10)
  train, _ = load_problem_sets(d, split_dir)
  full, _ = load_problem_sets(_data(train="synthetic:hard"), split_dir)
  assert len(train) == 10 and len(full) == 36
  assert {p.prompt for p in train} <= {p.prompt for p in full}
  # Kept in source order, the same subset every call (a sweep trains on one subset).
  assert [full.index(p) for p in train] == sorted(full.index(p) for p in train)
  assert load_problem_sets(d, split_dir)[0] == train
  d.split_seed = 3
  assert load_problem_sets(d, split_dir)[0] != train
  d.num_train = 37
  with pytest.raises(ValueError, match=r"num_train=37 exceeds the 36 training problems"):
    load_problem_sets(d, split_dir)


def test_synthetic_num_train_is_the_generated_count():
  train, sets = load_problem_sets(_data(num_train=50, num_val=8), "/nonexistent")
  assert len(train) == 50 and len(sets["val"]) == 8
  assert len(load_problem_sets(_data(num_val=8), "/nonexistent")[0]) == 4096


def test_synthetic_num_train_is_exact_beside_a_validation_set_it_overlaps(tmp_path):
  # A validation file of the generator's own problems: training is drawn around
  # them, so a data-size run trains on exactly data.num_train problems.
  from isojax.data import synthetic_problems
  val_file = tmp_path / "val.jsonl"
  overlap = load_problem_sets(_data(num_train=200), "/nonexistent")[0][::4]
  write_jsonl(overlap + synthetic_problems(10, seed=5), val_file)
  d = _data(num_train=200, val=f"own={val_file},held=heldout")
  train, sets = load_problem_sets(d, "/nonexistent")
  assert len(train) == 200 and [len(v) for v in sets.values()] == [60, 4]
  assert not {p.prompt for v in sets.values() for p in v} & {p.prompt for p in train}


def test_tri_mixture_has_its_weights_and_no_val_problem(split_dir):
  d = _data(train="mix:hard:0.5,easy:0.25,very_easy:0.25", num_train=40, num_val=5,
            val="hard=synthetic:hard,easy=synthetic:easy,very_easy=synthetic:very_easy")
  train, sets = load_problem_sets(d, split_dir)
  assert len(train) == 40 and len({p.prompt for p in train}) == 40
  kinds = [p.prompt.rstrip("=0123456789") for p in train]
  assert (kinds.count("hard"), kinds.count("easy"), kinds.count("very_easy")) == (20, 10, 10)
  assert not {p.prompt for v in sets.values() for p in v} & {p.prompt for p in train}
  # Overlapping splits make no mixture with the stated weights.
  write_jsonl(_problems("easy", 3), split_dir / "easy_too.jsonl")
  d.train, d.num_train = "mix:easy:0.5,easy_too:0.5", 4
  with pytest.raises(ValueError, match=r"splits 'easy' and 'easy_too' share [123] problems"):
    load_problem_sets(d, split_dir)
  d.train = "mix:hard:0.5,easy:0.25,very_easy:0.25"
  # 40 hard minus 5 for validation cannot give 0.5 * 80 = 40.
  d.num_train = 80
  with pytest.raises(ValueError, match=r"num_train=80 .*'hard'.*has 35"):
    load_problem_sets(d, split_dir)


def test_a_validation_prompt_written_differently_is_not_trained_on(split_dir, tmp_path,
                                                                  caplog):
  # Another file's copy of a training prompt: trailing newline, doubled space,
  # full-width digit (NFKC). Each is the same question to the model.
  val = [Problem("v0", "easy3=\n", "3"), Problem("v1", " easy 4=", "4"),
         Problem("v2", "easy\uff15=", "5"), Problem("v3", "easy  6 =", "6")]
  write_jsonl(val, tmp_path / "val.jsonl")
  train_file = tmp_path / "train.jsonl"
  write_jsonl(_problems("easy", 10) + [Problem("e6", "easy 6 =", "6")], train_file)
  caplog.set_level("INFO")
  train, sets = load_problem_sets(_data(train=str(train_file),
                                        val=f"v={tmp_path / 'val.jsonl'}"), split_dir)
  # "easy 4=" is another string than "easy4=" after collapsing: it stays.
  assert sorted(p.prompt for p in train) == sorted(
      {f"easy{i}=" for i in range(10)} - {"easy3=", "easy5="})
  assert "config.data.val['v']: removed 3 training problems" in caplog.text
  # Mixtures compare the same way.
  d = _data(train="mix:easy:0.5,hard:0.5", num_train=20, val=f"v={tmp_path / 'val.jsonl'}")
  train, _ = load_problem_sets(d, split_dir)
  assert not {"easy3=", "easy5="} & {p.prompt for p in train}


def test_user_files_are_read_with_the_configured_record_layout(split_dir, tmp_path):
  # veRL-style parquet: a chat prompt and the answer under reward_model.ground_truth.
  import datasets

  rows = [{"prompt": [{"role": "user", "content": f"q{i}="}],
           "reward_model": {"ground_truth": str(i)}} for i in range(12)]
  datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
  d = _data(train=str(tmp_path / "train.parquet"), num_val=3)
  with pytest.raises(ValueError, match=r"row 0: missing field 'answer'.*config.data."
                                       r"answer_field='answer' name the fields"):
    load_problem_sets(d, split_dir)
  d.answer_field = "reward_model.ground_truth"
  train, sets = load_problem_sets(d, split_dir)
  assert len(train) == 9 and len(sets["val"]) == 3
  assert {(p.prompt, p.answer) for p in train + sets["val"]} == {
      (f"q{i}=", str(i)) for i in range(12)}
  # A validation file and a `datasets` directory's split are read the same way.
  val = datasets.Dataset.from_list([{"question": "v0=", "sol": "0"}])
  datasets.DatasetDict({"train": val, "test": val}).save_to_disk(str(tmp_path / "dd"))
  d = _data(train=str(tmp_path / "dd"), val=f"v={tmp_path / 'dd'}", prompt_field="question",
            answer_field="sol")
  with pytest.raises(ValueError, match="splits"):
    load_problem_sets(d, split_dir)
  d.dataset_split = "test"
  with pytest.raises(ValueError, match="no training problems left"):
    load_problem_sets(d, split_dir)  # the one problem is the validation set's
