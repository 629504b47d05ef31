"""The in-memory sets' batched recipe: the per-image recipe's crops, flips and normalisation, drawn per image from
the torch stream, on batches of uint8 images decoded once."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from barter.training.data import build_batch_transform, build_datasets, build_eval_transform, load_mnist5k, resolve_spec
from barter.training.loading import MAX_WORKERS, batches_of, default_workers, resolve_workers
from barter.training.tensorsets import BatchTransform, TensorImages


def test_test_sets_match_the_per_image_evaluation_transform() -> None:
    spec = resolve_spec("mnist5k", img_size=16)
    data = build_datasets("mnist5k", img_size=16)
    _, _, x_test, _ = load_mnist5k()
    per_image = build_eval_transform(spec)
    for i in (0, 517, 999):
        torch.testing.assert_close(data.test[i][0], per_image(Image.fromarray(x_test[i]).convert("L")), rtol=0, atol=0)
    images, labels = next(batches_of(data.test, [[0, 517, 999]], torch.device("cpu"), workers=0))
    assert torch.equal(images, torch.stack([data.test[i][0] for i in (0, 517, 999)]))
    assert labels.tolist() == [data.test.targets[i] for i in (0, 517, 999)]


def test_which_recipes_run_on_batches() -> None:
    mnist, cifar = resolve_spec("mnist5k"), resolve_spec("cifar100")
    assert build_batch_transform(mnist) == BatchTransform(mnist.mean, mnist.std, padding=2, hflip=False)
    assert build_batch_transform(cifar, "light") == BatchTransform(cifar.mean, cifar.std, padding=2, hflip=True)
    assert build_batch_transform(cifar, "none") == BatchTransform(cifar.mean, cifar.std)
    assert build_batch_transform(cifar) is None and build_batch_transform(cifar, "vit") is None
    assert isinstance(build_datasets("fake", fake_size=8).train, TensorImages)
    assert not isinstance(build_datasets("fake", fake_size=8, recipe="cct").train, TensorImages)
    assert isinstance(build_datasets("fake", fake_size=8, recipe="cct").test, TensorImages)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), batch=st.integers(1, 6), channels=st.sampled_from([1, 3]),
       padding=st.integers(1, 4), hflip=st.booleans())
def test_each_image_is_a_window_of_its_padded_self(seed, batch, channels, padding, hflip) -> None:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(1, 256, (batch, channels, 8, 8), dtype=torch.uint8, generator=generator)
    transform = BatchTransform((0.0,) * channels, (1.0,) * channels, padding=padding, hflip=hflip)
    torch.manual_seed(seed)
    out = transform(images)
    torch.manual_seed(seed)
    assert torch.equal(out, transform(images))  # the torch stream decides every draw
    padded = torch.nn.functional.pad(images, (padding,) * 4).float() / 255  # ToTensor's scaling
    for image, source in zip(out, padded):
        windows = [source[:, r:r + 8, c:c + 8] for r in range(2 * padding + 1) for c in range(2 * padding + 1)]
        candidates = windows + ([w.flip(-1) for w in windows] if hflip else [])
        assert any(torch.equal(image, w) for w in candidates)


def test_draws_differ_per_image_and_cover_the_offsets() -> None:
    torch.manual_seed(0)
    image = torch.arange(64, dtype=torch.uint8).view(1, 1, 8, 8).expand(400, 1, 8, 8)
    out = BatchTransform((0.0,), (1.0,), padding=2, hflip=True)(image) * 255
    assert len({tuple(x.flatten().tolist()) for x in out}) == 2 * 25  # 5 x 5 offsets, flipped or not
    first_pixel = out[:, 0, 2, 2].round()
    assert 0.3 < (first_pixel == 18).float().mean() * 25 < 3  # the unshifted, unflipped window is not rare


def test_bad_tensor_set_is_refused() -> None:
    with pytest.raises(ValueError, match="uint8 images"):
        TensorImages(torch.zeros(2, 1, 4, 4), [0, 1], BatchTransform((0.0,), (1.0,)))
    with pytest.raises(ValueError, match="N labels"):
        TensorImages(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), [0], BatchTransform((0.0,), (1.0,)))


def test_a_subset_of_a_tensor_set_batches_through_its_indices() -> None:
    data = build_datasets("fake", fake_size=8, recipe="none")
    subset = torch.utils.data.Subset(data.train, [5, 2, 7])
    images, labels = next(batches_of(subset, [[0, 2]], torch.device("cpu"), workers=0))
    assert torch.equal(images, torch.stack([data.train[5][0], data.train[7][0]]))
    assert labels.tolist() == [data.train.targets[5], data.train.targets[7]]
    assert np.isfinite(images.numpy()).all()


def test_worker_default_shares_the_cores(monkeypatch) -> None:
    alone = default_workers()
    assert 0 <= alone <= MAX_WORKERS and resolve_workers(3) == 3 and resolve_workers(None) == alone
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    assert default_workers() == 0  # processes of one machine share its cores
