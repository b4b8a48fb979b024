"""pagefleet.gateway"""
