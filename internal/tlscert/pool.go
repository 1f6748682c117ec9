package tlscert

import (
	"crypto/x509"
	"fmt"
	"os"
)

// Pool reads the PEM certificates of file into a pool of roots, for the
// flag that names a CA (--log-ca, --worker-ca, --client-ca …); its errors
// start with the flag so the operator knows which one to fix.
func Pool(flag, file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s %s: no PEM certificate in it", flag, file)
	}
	return pool, nil
}
