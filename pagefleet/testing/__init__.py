"""pagefleet.testing: support code for tests and benches (synthetic paged batches, a
reference paged runner). Runtime packages never import it."""
