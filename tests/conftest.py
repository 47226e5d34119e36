"""The test session runs on the testing library (libonegraph_testing.so): importing
capi_testing first points $ONEGRAPH_LIB at it, so the engine and the og_test_* hooks come
from one library (an engine handle belongs to the library that made it)."""
import capi_testing  # noqa: F401  (selects the testing library)
