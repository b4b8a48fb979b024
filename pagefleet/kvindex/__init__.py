"""pagefleet.kvindex"""
