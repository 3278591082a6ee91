"""Runs in the online calibration's statistics actor (one detached Ray actor per app and pair):
the shared statistics of served traffic and the publisher of the cue sets they select."""
