"""The shipped multi-rank pytest kit: `run_ranks` launcher, failure diagnosis, memory budgets, report, plugin.

Import names are `megatron_testkit.*` so that nothing installed collides with a project's own
`fixtures`/`tests/fixtures` package or PyPI's `fixtures`; see ARCHITECTURE.md.
"""
