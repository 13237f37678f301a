"""The GPU check: a profile's real rendered launch script run on a CUDA machine (Makefile `gpu-check`)."""
