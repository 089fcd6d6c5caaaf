"""Helpers shared by the tests (tests/ and integration/): checking logs, running the CLI
and replication apps, building sink states. Test modules import from here, never from
each other."""
