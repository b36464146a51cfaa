"""One intra-op thread for the serving tests, as for the decoding tests: the models are tiny,
and on a shared 2-core machine extra torch threads spin-wait for each other."""

from tests.decoding.conftest import _single_thread  # noqa: F401  (an autouse fixture)
