package kettle

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"strings"

	"github.com/google/uuid"
)

// Device tokens are "<device uuid>.<mac>", mac = base64url(HMAC-SHA256(secret,
// "kettle-device-v1:" + uuid)). They are verified without a store round trip,
// and a fleet can be provisioned offline with `kettle token`.
const tokenContext = "kettle-device-v1:"

// DeviceToken derives the bearer token of device id.
func DeviceToken(secret []byte, id DeviceID) string {
	return id.String() + "." + base64.RawURLEncoding.EncodeToString(deviceMAC(secret, id))
}

func deviceMAC(secret []byte, id DeviceID) []byte {
	h := hmac.New(sha256.New, secret)
	h.Write([]byte(tokenContext))
	h.Write([]byte(id.String()))
	return h.Sum(nil)
}

// VerifyDeviceToken returns the device a token belongs to, comparing the MAC
// in constant time.
func VerifyDeviceToken(secret []byte, token string) (DeviceID, bool) {
	id, i := VerifyDeviceTokens(token, secret)
	return id, i == 0
}

// VerifyDeviceTokens checks a token against each secret in turn (empty
// ones skipped) and returns its device and the index of the secret that
// made it; -1 if none did. A server rotating its secret passes the new one,
// then the one being retired.
func VerifyDeviceTokens(token string, secrets ...[]byte) (DeviceID, int) {
	idPart, macPart, ok := strings.Cut(token, ".")
	if !ok || len(idPart) != 36 {
		return uuid.Nil, -1
	}
	id, err := uuid.Parse(idPart)
	if err != nil {
		return uuid.Nil, -1
	}
	mac, err := base64.RawURLEncoding.DecodeString(macPart)
	if err != nil {
		return uuid.Nil, -1
	}
	for i, secret := range secrets {
		if len(secret) > 0 && hmac.Equal(mac, deviceMAC(secret, id)) {
			return id, i
		}
	}
	return id, -1
}
