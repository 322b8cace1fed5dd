"""``python -m deepinfer_fx.generate``'s parts: its argument parser (``parser``) and what the
parsed arguments mean (``arguments``). Only torch-free modules here: ``--help`` answers at once."""
