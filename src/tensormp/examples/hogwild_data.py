"""The data of the Hogwild examples: scikit-learn's digits, split, augmented and standardised.

Shared by :mod:`tensormp.examples.hogwild_numpy` and :mod:`tensormp.examples.hogwild_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Dataset", "nudge", "load_data"]


@dataclass
class Dataset:
    """Digits split into train/test, pixels standardised (float32), labels int64.

    Attributes:
        x_train: ``(n_train, 64)`` float32.
        y_train: ``(n_train,)`` int64 in ``0..9``.
        x_test: ``(n_test, 64)`` float32.
        y_test: ``(n_test,)`` int64.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def nudge(images: np.ndarray) -> np.ndarray:
    """The images and their copies shifted by one pixel up, down, left and right (zero fill).

    The augmentation of scikit-learn's RBM digits example: 5x the data, same labels order
    ``[originals, up, down, left, right]``.

    Args:
        images: ``(n, 64)`` flattened 8x8 images.

    Returns:
        ``(5 n, 64)`` array of the same dtype.
    """
    img = images.reshape(-1, 8, 8)
    out = [img]
    for dy, dx in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        shifted = np.zeros_like(img)
        src_y, dst_y = slice(max(dy, 0), 8 + min(dy, 0)), slice(max(-dy, 0), 8 + min(-dy, 0))
        src_x, dst_x = slice(max(dx, 0), 8 + min(dx, 0)), slice(max(-dx, 0), 8 + min(-dx, 0))
        shifted[:, dst_y, dst_x] = img[:, src_y, src_x]
        out.append(shifted)
    return np.concatenate(out).reshape(-1, 64)


def load_data(seed: int = 0, test_fraction: float = 0.2, augment: bool = True) -> Dataset:
    """scikit-learn's ``load_digits``, split with ``seed``, augmented and standardised.

    The split is stratified (1437 train / 360 test images with the default fraction). With
    ``augment`` the training images are augmented with :func:`nudge` (5x: 7185 samples); the
    test set is left alone. Pixels (0..16) are scaled with the training set's per-pixel mean and
    ``std + 0.1`` (the 0.1 keeps always-blank pixels finite).

    Raises:
        ImportError: scikit-learn is missing (``pip install 'tensormp[examples]'``).
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the examples need scikit-learn and matplotlib: pip install 'tensormp[examples]'"
        ) from e
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    if augment:
        x_train, y_train = nudge(x_train), np.tile(y_train, 5)
    mean = x_train.mean(axis=0)
    scale = x_train.std(axis=0) + np.float32(0.1)
    return Dataset(
        ((x_train - mean) / scale).astype(np.float32),
        y_train,
        ((x_test - mean) / scale).astype(np.float32),
        y_test,
    )
