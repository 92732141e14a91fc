package config

// InterNetworking is runtime.internetworking_model with Kata's "default"
// resolved to what it means, "tcfilter".
func (c *Config) InterNetworking() string {
	if m := c.Runtime.InterNetworkingModel; m != "default" {
		return m
	}
	return "tcfilter"
}
