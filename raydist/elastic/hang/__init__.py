"""Hang diagnosis: which rank never arrived, at which collective, where every rank was, and each live rank's
Python stack; bounded in time whatever the store, the stopped rank or py-spy do.

- `heartbeat`: each rank's record of what it is doing, published to the attempt's store by a daemon
  thread that also keeps a view of every rank's record and watches this rank's in-flight collectives;
- `trigger`: what starts a diagnosis and when (a collective's exception that is a timeout, a collective
  pending too long where the group would abort without a word), and the groups' own timeout, which must
  come after detection and the diagnosis;
- `diagnosis`: `HangMonitor`, the heartbeat that can diagnose: it names the culprits, has every rank's
  stack written, and leaves `ranks.json` and a `hang` event, within `trigger.DIAGNOSE_BUDGET_S`.
"""
