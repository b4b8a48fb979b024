"""pagefleet.engine"""
