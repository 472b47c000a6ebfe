"""The BART denoising family (R9, Lewis et al. 2019), one folder: ``config.py`` (the
``[bart]`` section and row shape), ``compiler.py`` (the declared composition of noising
functions to encoder-decoder rows), ``render.py`` (its ``inspect`` view) and
``family.py`` (the glue). Its oracle lives with its tests.
"""
