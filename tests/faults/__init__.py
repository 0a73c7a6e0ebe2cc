"""Fault injection: runs of ``loom train`` SIGKILLed again and again (at random moments, inside saves,
retention and data preparation) must each resume from the newest complete checkpoint of their lineage and
end bitwise like a run that was never interrupted."""
