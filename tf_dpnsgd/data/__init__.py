"""Datasets of the paper's experiments and of the offline quickstart.

Every loader reads a local copy first (the on-disk layout the dataset is
distributed in), falls back to tensorflow-datasets, and otherwise raises
``FileNotFoundError`` naming the exact layout to provide and where to get it.

  * :mod:`tf_dpnsgd.data.cifar10`: CIFAR-10 images (``cifar-10-batches-py``),
    normalization constants and layer, seeded crop + flip augmentation.
  * :mod:`tf_dpnsgd.data.glue`: GLUE SST-2 sentences (``SST-2/{train,dev}.tsv``).
  * :mod:`tf_dpnsgd.data.digits`: scikit-learn's 8x8 digits, split offline.
  * :mod:`tf_dpnsgd.data.shakespeare`: tinyshakespeare's speaking roles as users
    (``input.txt``, local only: ``scripts/shakespeare_setup.sh``), next-character rows.

tensorflow-datasets and scikit-learn are optional: they are imported only by
the loaders that need them.
"""

from tf_dpnsgd.data import cifar10
from tf_dpnsgd.data import digits
from tf_dpnsgd.data import glue
from tf_dpnsgd.data import shakespeare

__all__ = ["cifar10", "digits", "glue", "shakespeare"]
