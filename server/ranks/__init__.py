"""Data-parallel aggregation: one coordinator made of several aggregator ranks (``fedpar serve --aggregator-ranks N``,
``fedpar simulate --aggregator-ranks N``).

Rank 0 is the control plane, as a one-process coordinator is: registry, sampling, tasks, the deadline and
first-K, strategy state, metrics, checkpoints. Every rank is an ingest plane (plane.py): it serves the global model
to the agents dealt to it and takes their uploads, with the same checks, folding them into its own partial sum.
One round, as rank 0 sees it (leader.py; the other ranks' side is ingest.py):

    open:  deal the cohort over the ranks (fewest agents first; in secure rounds all to rank 0, which unmasks),
           send each rank its agents' slots and the strategy's settings of the round (DP's clip norm), and wait
           until every rank holds them before any task is handed out
    round: another rank asks rank 0 to count each complete, checked upload, or a host's pre-summed partial's
           members all at once (control.py, answered by calls.py)
    close: tell the ranks how many uploads rank 0 counted for each; every rank waits for those folds; gather
           every rank's counts (which fails, changing nothing, if a rank is missing); all-reduce the partial sums,
           and hand rank 0 what its strategy needs beyond them (group.py: a robust rule's or a Flower strategy's
           updates, those a share cap held back, DP's count of unclipped updates)
    end:   rank 0's strategy finishes once (DP: the noise is added and accounted once); the new model is broadcast
           to every rank (or "unchanged")

Every control message is a protobuf message of fedpar.proto (RankBroadcast from rank 0, RankControl's calls to it),
read and written by one codec (messages.py). local.py starts ranks 1..N-1 as processes of this machine for
``simulate``. A rank other than 0 that dies or hangs is lost once its heartbeats stop for 3 s (or its process ends,
or a collective fails): rank 0 gives up the step it was in (steps.py), forms the group again over the ranks whose
heartbeats still arrive (group.py RankGroup.reform, leader.py), drops the lost rank's share of the open round and
goes on; the others rejoin (ingest.py). A fresh process started in a lost rank's slot (by local.py, or by
`serve`'s launcher: parallel/init.py) asks in the rendezvous store to be taken back, and rank 0 forms the group again
with it when the next round opens. Rank 0's death is the coordinator's: the same command resumes after the last
checkpointed round.
"""
