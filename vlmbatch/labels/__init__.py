"""Labelled evaluation, the moderation work around the model: result lines and the user's
labels read back (``read.py``: ``Scored``, ``Label``), a labelled evaluation
(``evaluation.py``, its maths in ``metrics.py``), thresholds calibrated on labels
(``calibration.py``, curves drawn by ``plots.py``: matplotlib), a job's HTML report
(``report.py``; what it counts, in one pass over the store: ``job_stats.py``; its pictures
of images, image lists and clips: ``thumbnails.py``), and review in
Label Studio (``review/``: tasks out, people's labels back). Runs no model: it reads answers
(a results file or a job's store, through ``jobs/``) and labels.
"""
