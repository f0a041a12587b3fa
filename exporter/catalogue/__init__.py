"""The metric catalogue: every family the exporter serves, declared once as data.

`families.py` declares each family (name, type, help, unit, labels, stability, section, the
meaning docs/metrics.md gives it); `family.py` is the declaration's shape. The exposition creates
its families from these declarations, `docs.py` writes docs/metrics.md from them, and the tests
check alert rules, recording rules, dashboards, the post-mortem readers and every `gpumem_` name
in the repository against them.
"""
