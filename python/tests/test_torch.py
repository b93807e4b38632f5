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


def test_one_table_looked_up_per_field_pushes_each_row_once_with_its_summed_gradient(tmp_path):
    path = tmp_path / "layout.toml"
    path.write_text(gt.layout_for(Tiny(), {"emb": 4}, chunk_elems=8))
    sgd_rows = ["--sparse-rule=sgd", "--sparse-lr=0.5"]
    with local_cluster(path, servers=2, rule="sgd", lr=0.5, extra_args=sgd_rows) as c, gaps.Client(
        c.coordinator, c.ca, c.cert, c.key
    ) as client:
        shared, other = gt.ShardedEmbedding(client, "emb"), gt.ShardedEmbedding(client, "emb")
        ids = torch.tensor([[1, 2, 3], [3, 2, 9]])
        every = np.array([1, 2, 3, 9], np.uint64)
        before = client.pull_rows("emb", every).copy()
        applied = [s["pushes_applied"] for s in client.stats()]
        # 26 per-field lookups of one table, through two modules, each weighted by its field number.
        loss = sum((j + 1) * (shared if j % 2 else other)(ids[:, j % 3]).sum() for j in range(26))
        loss.backward()
        expected = np.zeros((4, 4), np.float32)
        for j in range(26):
            for b in range(2):
                expected[list(every).index(int(ids[b, j % 3]))] += j + 1
        after = client.pull_rows("emb", every)
        np.testing.assert_allclose(after, before - 0.5 * expected, rtol=0, atol=1e-4)
        # One push per shard that holds any of the rows (two shards: at most one each).
        pushes = [s["pushes_applied"] - a for s, a in zip(client.stats(), applied)]
        assert all(p <= 1 for p in pushes) and sum(pushes) >= 1, pushes
        # A second step through the same modules works the same way (the last step's pulls are forgotten).
        before = after.copy()
        loss = shared(ids).sum() + other(ids[:, :1]).sum()
        loss.backward()
        expected = np.zeros((4, 4), np.float32)
        for i in ids.reshape(-1).tolist() + ids[:, 0].tolist():
            expected[list(every).index(i)] += 1
        np.testing.assert_allclose(client.pull_rows("emb", every), before - 0.5 * expected, rtol=0, atol=1e-4)

        # Ragged bags, as torch.nn.EmbeddingBag takes them.
        bag = gt.ShardedEmbeddingBag(client, "emb", mode="mean")
        rows = {int(i): r for i, r in zip(every, client.pull_rows("emb", every))}
        with torch.no_grad():
            out = bag(torch.tensor([1, 2, 3, 9]), torch.tensor([0, 1, 3]))
        want = np.stack([rows[1], (rows[2] + rows[3]) / 2, rows[9]])
        np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-6)

        # Evaluation and observers never create rows.
        held = sum(s["table_rows"] for s in client.stats())
        with torch.no_grad():
            unseen = shared(torch.tensor([[10**9, 10**9 + 1]]))
        # An unseen row reads as the initial value it would get, without being stored.
        np.testing.assert_array_equal(unseen[0].numpy(), client.pull_rows("emb", np.array([10**9, 10**9 + 1], np.uint64), create=False))
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key, observer=True) as observer:
            seen = gt.ShardedEmbedding(observer, "emb")(torch.tensor([[10**9 + 2, 1]]))
            np.testing.assert_array_equal(seen[0, 1].detach().numpy(), client.pull_rows("emb", np.array([1], np.uint64))[0])
        assert sum(s["table_rows"] for s in client.stats()) == held, "a lookup without training created rows"
        for e in (shared, other, bag):
            e.close()


class PerField(torch.nn.Module):
    """A user's model that owns its embedding: one table shared by every field, looked up per field."""

    def __init__(self, fields=26, dim=4):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, dim)
        self.fc = torch.nn.Linear(fields * dim, 1)

    def forward(self, ids):
        return self.fc(torch.cat([self.emb(ids[:, f]) for f in range(ids.shape[1])], dim=1)).squeeze(1)


def test_a_users_model_with_its_own_embedding_trains_through_the_shards(tmp_path):
    model = PerField()
    text = gt.layout_for(model)
    assert '[[table]]\nname = "emb"\ndim = 4' in text and "emb.weight" not in text, text
    path = tmp_path / "layout.toml"
    path.write_text(text)
    rows = ["--sparse-rule=sgd", "--sparse-lr=4.0"]
    with local_cluster(path, servers=2, rule="sgd", lr=0.5, extra_args=rows, init_std=0.05) as c, gaps.Client(
        c.coordinator, c.ca, c.cert, c.key
    ) as client:
        replaced = gt.shard_embeddings(model, client)
        assert list(replaced) == ["emb"] and isinstance(model.emb, gt.ShardedEmbedding)
        dense = gt.DenseParameters(client, model)  # the embedding's weight is no longer a parameter
        dense.pull()
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 60, (64, 26), generator=g)
        labels = (ids[:, 0] % 2).float()  # learnable from field 0's rows alone
        loss_fn = torch.nn.BCEWithLogitsLoss()
        losses = []
        for _ in range(60):
            loss = loss_fn(model(ids), labels)
            loss.backward()  # 26 lookups of one table: one push of its rows
            dense.push(pull=True)
            losses.append(loss.item())
        assert losses[-1] < 0.5 * losses[0], losses
        replaced["emb"].close()


def test_the_modules_own_initialisation_is_uploaded_once_and_every_worker_starts_from_it(tmp_path):
    torch.manual_seed(1)
    first, second = Tiny(), Tiny()  # two workers' modules, each with its own nn.init values
    assert not torch.equal(first.fc.weight, second.fc.weight)
    path = tmp_path / "layout.toml"
    path.write_text(gt.layout_for(first, {"emb": 4}, chunk_elems=8))
    with local_cluster(path, servers=2, rule="sgd", lr=0.5) as c:
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key) as a, gaps.Client(c.coordinator, c.ca, c.cert, c.key) as b:
            want = {n: p.detach().clone() for n, p in first.named_parameters()}
            assert gt.DenseParameters(a, first).initialize() is True
            assert gt.DenseParameters(b, second).initialize() is False, "the first writer won"
            for n, p in second.named_parameters():
                torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=0)
            # Not the shards' own zeros: the module's initialisation.
            assert torch.count_nonzero(second.fc.weight) > 0
            with gaps.Client(c.coordinator, c.ca, c.cert, c.key, observer=True) as observer:
                with pytest.raises(gaps.UnauthorizedError):
                    observer.initialize({n: p.detach().numpy() for n, p in first.named_parameters()})


def test_a_second_backward_over_one_forward_pushes_its_own_gradients(tmp_path):
    path = tmp_path / "layout.toml"
    path.write_text(gt.layout_for(Tiny(), {"emb": 4}, chunk_elems=8))
    with local_cluster(path, servers=2, rule="sgd", lr=0.5, extra_args=["--sparse-rule=sgd", "--sparse-lr=0.5"]) as c:
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
            emb = gt.ShardedEmbedding(client, "emb")
            ids = np.array([4, 5], np.uint64)
            before = client.pull_rows("emb", ids).copy()
            out = emb(torch.tensor([4, 5]))
            out.sum().backward(retain_graph=True)  # gradient 1 per element
            (2 * out).sum().backward()  # another loss over the same forward: gradient 2
            np.testing.assert_allclose(client.pull_rows("emb", ids), before - 0.5 * 3, rtol=0, atol=1e-5)
            emb.close()
