"""pagefleet.daemon"""
