"""Live reactions: what runs on every sampling tick after the analysis, reacting to what it
decided. The flight recorder (recorder.py) keeps the last hour on disk when something goes
wrong; the allocation-history requester (alloc_history.py) asks a probed process to record its
allocations. Both run inside the daemon and never raise into it. The offline tools that read
what they leave behind (analyze, report, explain, promquery, trace) are in postmortem/."""
