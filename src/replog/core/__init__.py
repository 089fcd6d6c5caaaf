"""The log's core on storage: its history and snapshots, its files, leases, fencing and
the protocol that commits staged files (pure layouts are :mod:`replog.format`)."""
