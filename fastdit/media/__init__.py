"""Files and pictures people look at: generated videos (``video.py``) and attention-mask pictures (``pictures.py``)."""
