"""gaps.torch against a real local cluster: a PyTorch model whose embedding rows and dense parameters live
on the shards trains, and its gradients reach the shards exactly."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/test installs it)")

import gaps  # noqa: E402
import gaps.torch as gt  # noqa: E402
from gaps.testing import local_cluster  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self, fields=3, dim=4):
        super().__init__()
        self.fc = torch.nn.Linear(fields * dim, 1)

    def forward(self, emb):
        return self.fc(emb.flatten(1)).squeeze(1)


def test_rows_and_dense_parameters_move_exactly_as_sgd_says(tmp_path):
    model = Tiny()
    path = tmp_path / "layout.toml"
    path.write_text(gt.layout_for(model, {"emb": 4}, chunk_elems=8))
    with local_cluster(path, servers=2, rule="sgd", lr=0.5) as c, gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
        # The table's own rule is Adagrad by default; compare the dense side exactly, the rows by direction.
        emb = gt.ShardedEmbedding(client, "emb")
        dense = gt.DenseParameters(client, model)
        dense.pull()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids = torch.tensor([[1, 2, 3], [3, 2, 9]])
        rows_before = client.pull_rows("emb", np.array([1, 2, 3, 9], np.uint64)).copy()
        e = emb(ids)
        # (The shards initialise dense tensors to zero, so the rows also get a gradient of their own.)
        loss = model(e).sum() + e.sum()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        dense.push()
        dense.pull()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), before[n] - 0.5 * grads[n], rtol=0, atol=1e-6)
        # push(pull=True): the shards answer with the new values, copied in as pull() would.
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = model(emb(ids)).sum()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        dense.push(pull=True)
        for n, p in model.named_parameters():
            assert p.grad is None
            torch.testing.assert_close(p.detach(), before[n] - 0.5 * grads[n], rtol=0, atol=1e-6)
        pushed = {n: p.detach().clone() for n, p in model.named_parameters()}
        dense.pull()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), pushed[n], rtol=0, atol=0)
        rows_after = client.pull_rows("emb", np.array([1, 2, 3, 9], np.uint64))
        assert not np.allclose(rows_after, rows_before), "the rows' gradients were pushed in backward"
        emb.close()


def test_a_torch_model_with_sharded_embeddings_learns(tmp_path):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    fields, dim, vocab = 3, 4, 50
    truth = rng.normal(size=vocab)  # each id's contribution to the logit
    model = Tiny(fields, dim)
    path = tmp_path / "layout.toml"
    path.write_text(gt.layout_for(model, {"emb": dim}, chunk_elems=16))
    with local_cluster(path, servers=2, rule="sgd", lr=0.2) as c, gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
        emb = gt.ShardedEmbedding(client, "emb")
        dense = gt.DenseParameters(client, model)
        loss_fn = torch.nn.BCEWithLogitsLoss()

        def batch():
            ids = rng.integers(0, vocab, size=(64, fields))
            y = (truth[ids].sum(1) > 0).astype(np.float32)
            return torch.from_numpy(ids), torch.from_numpy(y)

        losses = []
        nxt = batch()
        dense.pull()
        for _ in range(150):
            ids, y = nxt
            nxt = batch()
            emb.prefetch(nxt[0])  # the next batch's rows arrive while this one computes
            loss = loss_fn(model(emb(ids)), y)
            loss.backward()
            dense.push(pull=True)  # the new values come back with the push's answer
            losses.append(loss.item())
        emb.close()
        first, last = np.mean(losses[:10]), np.mean(losses[-10:])
        assert last < 0.75 * first, (first, last)


def test_mismatched_models_are_refused(tmp_path):
    model = Tiny()
    path = tmp_path / "layout.toml"
    path.write_text(gt.layout_for(model, {"emb": 4}, chunk_elems=8))
    with local_cluster(path, servers=1) as c, gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
        with pytest.raises(gaps.UnknownNameError):
            gt.DenseParameters(client, torch.nn.Linear(3, 1))
        with pytest.raises(gaps.UnknownNameError):
            gt.ShardedEmbedding(client, "nope")
        emb = gt.ShardedEmbedding(client, "emb")
        with pytest.raises(TypeError):
            emb(torch.tensor([0.5]))
        bag = gt.ShardedEmbeddingBag(client, "emb", mode="mean")
        ids = torch.tensor([[1, 2], [2, 2]])
        torch.testing.assert_close(bag(ids), emb(ids).mean(dim=1))
        assert bag(ids).shape == (2, 4)
        emb.close()
        bag.close()


def test_dense_parameters_refuse_a_module_whose_shape_differs_but_size_matches(cluster):
    class Transposed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 5))  # the cluster serves w as (5, 4)
            self.b = torch.nn.Parameter(torch.zeros(4))

    with gaps.Client(cluster.coordinator, cluster.ca, cluster.cert, cluster.key) as client:
        with pytest.raises(gaps.ShapeError, match=r"\(4, 5\).*\(5, 4\)"):
            gt.DenseParameters(client, Transposed())
