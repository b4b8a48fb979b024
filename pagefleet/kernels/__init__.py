"""pagefleet.kernels"""
