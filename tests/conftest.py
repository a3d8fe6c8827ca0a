"""Suite-wide: a cache directory of the run's own, unless the caller (CI, a developer) chose one.

The probe caches the measured tinygemm layout there and the kernels cache the default model; keeping a run's
cache out of the user's home means a test never passes on what an earlier run left behind.
"""

import os
import tempfile

os.environ.setdefault("EDGE_SELECT_CACHE_DIR", tempfile.mkdtemp(prefix="edge-select-test-cache-"))
