"""Offline AWQ/GPTQ/int8 quantisation (issue 7). Not built yet: nothing here runs."""
