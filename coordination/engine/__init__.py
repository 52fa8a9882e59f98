"""The coordinator's engine, without Ray: every coordinated operation
(`coordinator_core`), its phase table, options, journal, results, and how
it fans calls out to participants through the `host` protocols."""
